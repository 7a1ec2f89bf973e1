"""``python -m bench.stage_proc --bench-d-model 512 --bench-n-layer 8 --bench-n-head 8``:
a stage server whose model has other dimensions than its preset's; ``python -m
bench.stage_proc trainer --bench-...``: a trainer of that model.

The benches compare the mesh with other systems at d_model 256, 512 and 1024 with 8
layers, which no preset has. Everything else is the stock stage server
(``services.stage_server``: same main, app, routes, runtime and settings from ``SWARM_*``,
``--stage auto`` and moves between stages, served in the same process) or the stock
trainer (``services.trainer``, which checks that the servers run the model it expects);
only the model configuration is the preset's with these dimensions replaced.
"""

from __future__ import annotations

import sys

from pydantic import Field

from shared.config import ModelSettings, StageServerSettings, TrainerSettings
from shared.model import GPTConfig, config_from_preset


class SizedModelSettings(ModelSettings):
    bench_d_model: int = Field(0, ge=0, description="d_model of the model (0: the preset's)")
    bench_n_layer: int = Field(0, ge=0, description="layers of the model (0: the preset's)")
    bench_n_head: int = Field(0, ge=0, description="attention heads (0: the preset's)")

    def gpt_config(self) -> GPTConfig:
        dims = {"d_model": self.bench_d_model, "n_layer": self.bench_n_layer, "n_head": self.bench_n_head}
        return config_from_preset(self.model, **{k: v for k, v in dims.items() if v})


class SizedStageSettings(SizedModelSettings, StageServerSettings):
    pass


class SizedTrainerSettings(SizedModelSettings, TrainerSettings):
    pass


def main(argv: list[str] | None = None) -> int:
    """The stock server's main (coordinator lookup, ``--stage auto``, moves) with these
    settings; with ``trainer`` first, the stock trainer's."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trainer"]:
        from services.trainer.__main__ import main as train

        return train(argv[1:], settings_class=SizedTrainerSettings)
    from services.stage_server.__main__ import main as serve

    return serve(argv, settings_class=SizedStageSettings)


if __name__ == "__main__":
    sys.exit(main())
