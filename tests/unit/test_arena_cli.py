"""``python -m bench.arena``'s options: bad input is refused before anything starts."""

from __future__ import annotations

import pytest

from bench.arena import main


@pytest.mark.parametrize(
    "args, said",
    [
        (["--first", "2"], "--first takes a server's name"),
        (["--first", "s"], "--first takes a server's name"),
        (["--mesh", "1by8"], "--mesh takes settings like"),
        (["--beta1", "1.5"], "--beta1 must be in (0, 1)"),
        (["--local-steps", "4"], "--local-steps takes a count >= 1, with --sync local"),
        (["--round-codecs", "int4,int3"], "--round-codecs: each one of fp32, fp16, bf16, int8, int4"),
    ],
)
def test_a_bad_option_is_refused_with_what_it_takes(args, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["heterogeneous", "--no-pipelining", "--out", "/nonexistent/never-written", *args])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
