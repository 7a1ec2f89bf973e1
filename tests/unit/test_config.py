"""Settings from SWARM_* variables and flags, their validation, stage URL lists, the CLI."""

from __future__ import annotations

import os

import pytest

from services.cli import main as cli_main
from shared.config import (
    CommonSettings,
    CoordinatorSettings,
    FaultInjection,
    ModelSettings,
    PlacementSettings,
    StageServerSettings,
    TrainerSettings,
    is_test_only,
    known_settings_fields,
    parse_settings,
    settings_fields,
    unknown_swarm_variables,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No SWARM_* variable of the caller's environment leaks in (settings read them case-insensitively)."""
    for key in list(os.environ):
        if key.upper().startswith("SWARM_"):
            monkeypatch.delenv(key)


def urls(n: int) -> str:
    return ";".join(f"http://h{i}:81{i:02d}" for i in range(n))


# --- environment and flags -----------------------------------------------------------


def test_defaults_without_environment():
    s = TrainerSettings()
    assert (s.model, s.num_stages, s.seed, s.wire_codec, s.device) == ("tiny", 4, 0, "int8", "cpu")
    assert (s.steps, s.seq_len, s.in_flight, s.stages, s.corpus) == (200, 128, 4, "", "")


def test_settings_read_swarm_environment_variables(monkeypatch):
    monkeypatch.setenv("SWARM_STEPS", "7")
    monkeypatch.setenv("SWARM_NUM_STAGES", "2")
    monkeypatch.setenv("SWARM_WIRE_CODEC", "bf16")
    monkeypatch.setenv("SWARM_FORWARD_TIMEOUT_S", "2.5")
    monkeypatch.setenv("SWARM_RUN_ID", "exp-1")
    monkeypatch.setenv("SWARM_STAGES", "http://a:1;http://b:2")
    s = TrainerSettings()
    assert (s.steps, s.num_stages, s.wire_codec, s.forward_timeout_s, s.run_id) == (7, 2, "bf16", 2.5, "exp-1")
    assert s.stage_urls() == [["http://a:1"], ["http://b:2"]]
    monkeypatch.setenv("SWARM_PORT", "8300")
    monkeypatch.setenv("SWARM_STAGE", "3")
    server = StageServerSettings()
    assert (server.port, server.stage, server.num_stages) == (8300, 3, 2)


def test_flags_override_environment(monkeypatch, capsys):
    monkeypatch.setenv("SWARM_STEPS", "7")
    monkeypatch.setenv("SWARM_SEQ_LEN", "32")
    s = parse_settings(
        TrainerSettings, ["--steps", "9", "--in-flight", "2", "--wire-codec", "fp16"], prog="swarm train"
    )
    assert isinstance(s, TrainerSettings)
    assert s.steps == 9  # flag beats env
    assert s.seq_len == 32  # env still applies where no flag is given
    assert (s.in_flight, s.wire_codec) == (2, "fp16")
    assert parse_settings(TrainerSettings, [], prog="swarm train").steps == 7
    assert capsys.readouterr().err == ""  # no warning without unknown variables


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--steps", "0"], "steps"),
        (["--steps", "many"], "steps"),
        (["--wire-codec", "fp8"], "wire_codec"),
        (["--run-id", "has space"], "run_id"),
        (["--in-flight", "5000"], "in_flight"),
    ],
)
def test_bad_flag_value_exits_2_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, argv, prog="swarm train")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "swarm train" in err and "invalid settings" in err
    assert f"\n{field}\n" in err  # pydantic puts the field's name on a line of its own


def test_bad_environment_value_exits_2_naming_the_field(monkeypatch, capsys):
    monkeypatch.setenv("SWARM_PORT", "70000")
    with pytest.raises(SystemExit) as exc:
        parse_settings(StageServerSettings, [], prog="swarm server")
    assert exc.value.code == 2
    assert "\nport\n" in capsys.readouterr().err


def test_unknown_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, ["--stepz", "3"], prog="swarm train")
    assert exc.value.code == 2
    assert "--stepz" in capsys.readouterr().err


def test_every_field_has_a_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, ["--help"], prog="swarm train")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in settings_fields(TrainerSettings):
        assert f"--{name.replace('_', '-')}" in out
    with pytest.raises(SystemExit):
        parse_settings(CoordinatorSettings, ["--help"], prog="swarm coordinator")
    out = capsys.readouterr().out
    for name in ("--placement", "--placement-min-gain", "--placement-bandwidth-gbps", "--rebalance-every-s"):
        assert f"{name} " in out, name


def test_fault_injection_settings_are_marked_test_only():
    fields = settings_fields(StageServerSettings)
    test_only = {name for name, field in fields.items() if is_test_only(field)}
    assert test_only == {name for name in fields if name.startswith("inject_")} and test_only
    for name in test_only:
        assert fields[name].description.startswith("TEST ONLY"), name


def test_help_names_test_only_settings_only_as_such_and_their_flags_work(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(StageServerSettings, ["--help"], prog="swarm server")
    assert exc.value.code == 0
    options, _, epilog = capsys.readouterr().out.partition("test only, never set in production:")
    assert "--inject" not in options and "fault injection" not in options
    assert "--inject-delay-s" in epilog and "--inject-byzantine-factor" in epilog
    s = parse_settings(StageServerSettings, ["--inject-delay-s", "0.5"], prog="swarm server")
    assert s.inject.delay_s == 0.5


# --- validators ----------------------------------------------------------------------


def test_unknown_model_names_swarm_model(monkeypatch):
    with pytest.raises(ValueError, match="SWARM_MODEL"):
        ModelSettings(model="gpt-17")
    monkeypatch.setenv("SWARM_MODEL", "gpt-17")
    with pytest.raises(ValueError, match="SWARM_MODEL"):
        TrainerSettings()


@pytest.mark.parametrize("device", ["gpu", "CPU", "", "mps"])
def test_bad_device_names_swarm_device(device):
    with pytest.raises(ValueError, match="SWARM_DEVICE"):
        CommonSettings(device=device)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_good_devices(device):
    assert CommonSettings(device=device).device == device


@pytest.mark.parametrize("device", ["cudax", "cuda:abc", "cuda:"])
def test_malformed_cuda_device_names_swarm_device(device):
    with pytest.raises(ValueError, match="SWARM_DEVICE"):
        CommonSettings(device=device)


@pytest.mark.parametrize("block", [0, 3, 100, -64])
def test_bad_int8_block_names_swarm_int8_block(block, monkeypatch):
    with pytest.raises(ValueError, match="SWARM_INT8_BLOCK"):
        ModelSettings(int8_block=block)
    monkeypatch.setenv("SWARM_INT8_BLOCK", str(block))
    with pytest.raises(ValueError, match="SWARM_INT8_BLOCK"):
        TrainerSettings()


def test_good_int8_block_accepted():
    from shared.codec import DEFAULT_INT8_BLOCK, INT8_BLOCK_SIZES

    assert ModelSettings().int8_block == DEFAULT_INT8_BLOCK
    for block in INT8_BLOCK_SIZES:
        assert ModelSettings(int8_block=block).int8_block == block


def test_unknown_field_keyword_is_rejected():
    with pytest.raises(ValueError, match="stepz"):
        TrainerSettings(stepz=3)


# --- TrainerSettings.stage_urls ------------------------------------------------------


def test_stage_urls_parses_replicas_and_stages():
    s = TrainerSettings(stages="http://a:1,http://b:2/;http://c:3; http://d:4/ ,https://e:5//;http://f:6", num_stages=4)
    assert s.stage_urls() == [
        ["http://a:1", "http://b:2"],
        ["http://c:3"],
        ["http://d:4", "https://e:5"],
        ["http://f:6"],
    ]


def test_stage_urls_tolerates_empty_replica_entries():
    s = TrainerSettings(stages="http://a,,http://b,;http://c;http://d;http://e", num_stages=4)
    assert s.stage_urls()[0] == ["http://a", "http://b"]


@pytest.mark.parametrize(
    "stages",
    [
        "",  # nothing
        urls(3),  # too few
        urls(5),  # too many
        urls(4) + ";",  # a trailing ';' is a fifth, empty stage
        "http://a;;http://c;http://d",  # an empty stage
        "http://a; , ;http://c;http://d",  # only blanks
    ],
)
def test_stage_urls_wrong_stage_count_or_empty_stage_names_swarm_stages(stages):
    with pytest.raises(ValueError, match="SWARM_STAGES"):
        TrainerSettings(stages=stages, num_stages=4).stage_urls()


@pytest.mark.parametrize("bad", ["a0:8100", "ftp://a0", "//a0", "localhost"])
def test_stage_urls_non_http_url_names_swarm_stages(bad):
    s = TrainerSettings(stages=f"http://ok,{bad};http://c;http://d;http://e", num_stages=4)
    with pytest.raises(ValueError, match="SWARM_STAGES") as exc:
        s.stage_urls()
    assert bad in str(exc.value)


def test_stage_urls_follows_num_stages(monkeypatch):
    monkeypatch.setenv("SWARM_NUM_STAGES", "2")
    monkeypatch.setenv("SWARM_STAGES", "http://a;http://b,http://c")
    assert TrainerSettings().stage_urls() == [["http://a"], ["http://b", "http://c"]]
    with pytest.raises(ValueError, match="SWARM_STAGES"):
        TrainerSettings(num_stages=3).stage_urls()


# --- unknown variables, frozen objects -----------------------------------------------


def test_unknown_swarm_variables_reports_typos_only(monkeypatch, capsys):
    monkeypatch.setenv("SWARM_STEPS", "3")
    monkeypatch.setenv("SWARM_STEPZ", "3")
    monkeypatch.setenv("SWARM_PORT", "8100")  # a stage server setting: known too
    monkeypatch.setenv("NOT_SWARM_X", "1")
    assert unknown_swarm_variables() == ["SWARM_STEPZ"]
    s = parse_settings(TrainerSettings, [], prog="swarm train")
    assert s.steps == 3
    err = capsys.readouterr().err
    assert "SWARM_STEPZ" in err and "warning" in err and "SWARM_STEPS " not in err


def test_known_fields_cover_every_settings_class():
    known = known_settings_fields()
    for cls in (CommonSettings, ModelSettings, StageServerSettings, TrainerSettings, CoordinatorSettings):
        assert set(settings_fields(cls)) <= known
    assert {"steps", "port", "stages", "model", "device", "placement", "placement_min_gain", "inject_garbage"} <= known
    assert not {"inject", "placement_mode"} & known  # a section has no variable of its own, but placement's mode


@pytest.mark.parametrize(
    "cls, field, value",
    [(TrainerSettings, "steps", 3), (StageServerSettings, "port", 1), (CommonSettings, "device", "cuda")],
)
def test_settings_are_frozen(cls, field, value):
    s = cls()
    before = getattr(s, field)
    with pytest.raises(ValueError):  # pydantic's ValidationError (frozen_instance)
        setattr(s, field, value)
    assert getattr(s, field) == before


# --- sections: placement and fault injection ----------------------------------------

# Every setting of a section by its variable: (value in the environment, section, field, value read).
SECTION_SETTINGS = [
    (CoordinatorSettings, "SWARM_PLACEMENT", "topology", "placement", "mode", "topology"),
    (CoordinatorSettings, "SWARM_PLACEMENT_MIN_GAIN", "0.25", "placement", "min_gain", 0.25),
    (CoordinatorSettings, "SWARM_PLACEMENT_MAX_MOVES", "0.5", "placement", "max_moves", 0.5),
    (CoordinatorSettings, "SWARM_PLACEMENT_BUDGET_S", "7", "placement", "budget_s", 7.0),
    (CoordinatorSettings, "SWARM_PLACEMENT_BANDWIDTH_GBPS", "10", "placement", "bandwidth_gbps", 10.0),
    (StageServerSettings, "SWARM_INJECT_DELAY_S", "0.5", "inject", "delay_s", 0.5),
    (StageServerSettings, "SWARM_INJECT_GARBAGE", "0.25", "inject", "garbage", 0.25),
    (StageServerSettings, "SWARM_INJECT_BYZANTINE", "scale", "inject", "byzantine", "scale"),
    (StageServerSettings, "SWARM_INJECT_BYZANTINE_FACTOR", "3", "inject", "byzantine_factor", 3.0),
]


def test_every_section_setting_is_listed_here():
    listed = {var.removeprefix("SWARM_").lower() for _, var, *_ in SECTION_SETTINGS}
    fields = set(settings_fields(CoordinatorSettings)) | set(settings_fields(StageServerSettings))
    assert {f for f in fields if f.startswith(("placement", "inject_"))} == listed


@pytest.mark.parametrize("cls, var, raw, section, field, value", SECTION_SETTINGS)
def test_section_settings_read_their_flat_variables_and_flags(cls, var, raw, section, field, value, monkeypatch):
    default = getattr(getattr(cls(), section), field)
    assert default != value
    monkeypatch.setenv(var, raw)
    assert getattr(getattr(cls(), section), field) == value
    flag = "--" + var.removeprefix("SWARM_").lower().replace("_", "-")
    monkeypatch.delenv(var)
    assert getattr(getattr(parse_settings(cls, [flag, raw], prog="swarm"), section), field) == value
    flat = var.removeprefix("SWARM_").lower()
    assert getattr(getattr(cls(**{flat: raw}), section), field) == value  # the flat keyword too


def test_a_sections_variables_flags_and_keywords_combine(monkeypatch, capsys):
    monkeypatch.setenv("SWARM_PLACEMENT", "topology")
    monkeypatch.setenv("SWARM_PLACEMENT_MIN_GAIN", "0.3")
    s = parse_settings(CoordinatorSettings, ["--placement-budget-s", "5", "--placement-min-gain", "0.4"], prog="c")
    assert s.placement == PlacementSettings(mode="topology", min_gain=0.4, budget_s=5.0)  # the flag beats the env
    assert capsys.readouterr().err == ""
    assert CoordinatorSettings(placement="throughput").placement.min_gain == 0.3  # a flag of the mode keeps the rest
    whole = CoordinatorSettings(placement=PlacementSettings(max_moves=0.5)).placement  # the environment fills it in
    assert (whole.mode, whole.min_gain, whole.max_moves) == ("topology", 0.3, 0.5)
    assert CoordinatorSettings(placement={"min_gain": 0.1}, placement_min_gain=0.2).placement.min_gain == 0.2
    assert StageServerSettings(inject=FaultInjection(garbage=1.0)).inject.garbage == 1.0


@pytest.mark.parametrize(
    "cls, var, raw",
    [
        (CoordinatorSettings, "SWARM_PLACEMENT", "nearest"),
        (CoordinatorSettings, "SWARM_PLACEMENT_MIN_GAIN", "-1"),
        (CoordinatorSettings, "SWARM_PLACEMENT_BUDGET_S", "soon"),
        (StageServerSettings, "SWARM_INJECT_GARBAGE", "2"),
        (StageServerSettings, "SWARM_INJECT_BYZANTINE", "evil"),
    ],
)
def test_a_bad_section_value_names_the_setting(cls, var, raw, monkeypatch, capsys):
    name = var.removeprefix("SWARM_").lower()
    with pytest.raises(ValueError, match=f"(?m)^{name}$"):  # its own line, as every setting's error
        cls(**{name: raw})
    monkeypatch.setenv(var, raw)
    with pytest.raises(SystemExit) as exc:
        parse_settings(cls, [], prog="swarm")
    assert exc.value.code == 2
    assert f"\n{name}\n" in capsys.readouterr().err


def test_a_typo_of_a_section_variable_is_warned_about_and_of_a_keyword_refused(monkeypatch, capsys):
    for typo in ({"placement_min_gian": 0.1}, {"placement": {"min_gian": 0.1}}):
        with pytest.raises(ValueError, match="(?m)^placement_min_gian$"):
            CoordinatorSettings(**typo)
    monkeypatch.setenv("SWARM_PLACEMENT_MIN_GIAN", "0.3")
    monkeypatch.setenv("SWARM_PLACEMENT_MIN_GAIN", "0.2")
    monkeypatch.setenv("SWARM_INJECT_DELAY_S", "0.1")
    assert unknown_swarm_variables() == ["SWARM_PLACEMENT_MIN_GIAN"]
    s = parse_settings(CoordinatorSettings, [], prog="swarm coordinator")
    assert s.placement.min_gain == 0.2
    err = capsys.readouterr().err
    assert "SWARM_PLACEMENT_MIN_GIAN" in err and "warning" in err and "SWARM_PLACEMENT_MIN_GAIN " not in err


@pytest.mark.parametrize(
    "cls, section, field, value",
    [(CoordinatorSettings, "placement", "min_gain", 0.5), (StageServerSettings, "inject", "garbage", 1.0)],
)
def test_sections_are_frozen(cls, section, field, value):
    s = cls()
    with pytest.raises(ValueError):  # pydantic's ValidationError (frozen_instance)
        setattr(getattr(s, section), field, value)
    with pytest.raises(ValueError):
        setattr(s, section, getattr(s, section))
    assert getattr(getattr(s, section), field) != value


# --- the swarm command ---------------------------------------------------------------


def test_cli_without_command_prints_usage_and_returns_2(capsys):
    assert cli_main([]) == 2
    out = capsys.readouterr().out
    assert "usage: swarm COMMAND" in out
    for command in ("server", "train", "up"):
        assert f"  {command} " in out


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_cli_help_returns_0(flag, capsys):
    assert cli_main([flag]) == 0
    assert "usage: swarm COMMAND" in capsys.readouterr().out


def test_cli_unknown_command_returns_2(capsys):
    assert cli_main(["trian"]) == 2
    captured = capsys.readouterr()
    assert "unknown command 'trian'" in captured.err and "usage: swarm COMMAND" in captured.err
    assert captured.out == ""


def test_swarm_up_takes_the_tokenizer_from_swarm_tokenizer_as_its_error_says(monkeypatch, tmp_path):
    """A Llama preset without a tokenizer stops swarm up with "set SWARM_TOKENIZER=DIR": setting
    it must then be enough (swarm up's own --tokenizer default ignored it); the flag still wins."""
    from services.local_swarm import parse_args

    monkeypatch.delenv("SWARM_TOKENIZER", raising=False)
    assert parse_args(["--model", "llama-tiny"]).tokenizer == ""
    monkeypatch.setenv("SWARM_TOKENIZER", str(tmp_path))
    assert parse_args(["--model", "llama-tiny"]).tokenizer == str(tmp_path)
    assert parse_args(["--tokenizer", "other"]).tokenizer == "other"


def test_cli_sub_command_help_lists_its_settings(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "swarm train" in out and "--stages" in out and "--in-flight" in out
