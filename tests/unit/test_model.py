"""The model and its cut into stages, without any networking."""

from __future__ import annotations

import pytest
import torch

from shared.model import PRESETS, GPTConfig, StageModel, build_gpt, build_stage, config_from_preset, partition


@pytest.mark.parametrize("n_layer,num_stages", [(4, 4), (4, 1), (12, 5), (24, 7), (8, 3)])
def test_partition_covers_every_layer_once_in_order(n_layer, num_stages):
    specs = partition(GPTConfig(n_layer=n_layer), num_stages)
    assert [s.index for s in specs] == list(range(num_stages))
    assert [i for s in specs for i in s.layers] == list(range(n_layer))
    sizes = [len(s.layers) for s in specs]
    assert max(sizes) - min(sizes) <= 1
    assert specs[0].is_first and specs[-1].is_last


def test_partition_gives_spare_layers_to_middle_stages():
    # 5 stages of 12 layers: two spare layers go to the middle, not to the embedding/head stages
    sizes = [len(s.layers) for s in partition(GPTConfig(n_layer=12), 5)]
    assert sizes == [2, 3, 3, 2, 2]


@pytest.mark.parametrize("num_stages", [0, 5])
def test_partition_refuses_impossible_cuts(num_stages):
    with pytest.raises(ValueError, match="num_stages"):
        partition(GPTConfig(n_layer=4), num_stages)


def test_unknown_preset_names_the_setting():
    with pytest.raises(ValueError, match="SWARM_MODEL"):
        config_from_preset("enormous")


def test_presets_span_tiny_to_about_a_billion():
    def count(cfg):  # parameters without building the model
        d = cfg.d_model
        return 2 * cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * 12 * d * d

    assert count(PRESETS["tiny"]) < 2e6
    assert 0.9e9 < count(PRESETS["xl"]) < 1.5e9


def test_stages_together_are_the_whole_model_with_the_same_weights():
    cfg = PRESETS["tiny"]
    whole = build_gpt(cfg, seed=3).state_dict()
    parts = {}
    for s in range(4):
        stage_state = build_stage(cfg, s, 4, seed=3).state_dict()
        assert not parts.keys() & stage_state.keys()
        parts.update(stage_state)
    assert parts.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(parts[name], value), name


def test_chained_stages_compute_the_whole_model_loss():
    cfg = PRESETS["tiny"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, dims=1)
    x = tokens
    stages = [build_stage(cfg, s, 4, seed=0) for s in range(4)]
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, 32, cfg.d_model)
    loss = stages[-1](x, targets)
    assert torch.allclose(loss, build_gpt(cfg, seed=0)(tokens, targets), rtol=1e-6)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1  # an untrained model is uniform


def test_different_seeds_give_different_weights():
    a, b = build_gpt(PRESETS["tiny"], seed=0), build_gpt(PRESETS["tiny"], seed=1)
    assert not torch.equal(a.wte.weight, b.wte.weight)


def test_last_stage_without_targets_returns_logits():
    cfg = PRESETS["tiny"]
    stage = build_stage(cfg, 3, 4, seed=0)
    assert isinstance(stage, StageModel) and stage.spec.is_last
    assert stage(torch.zeros(1, 5, cfg.d_model)).shape == (1, 5, cfg.vocab_size)
