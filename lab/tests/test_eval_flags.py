"""`vlkv eval` refuses a flag its mode would ignore, before it loads a model."""

from __future__ import annotations

import pytest
from vlkv.deploy.cli.main import main


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--zoo", "--members", "text", "--budgets", "0.02,0.05"], "--budgets"),  # the zoo runs 1, 2, 5, 10%
        (["--zoo", "--api", "--concurrency", "2"], "--concurrency"),  # the zoo's --api ignores it
        (["--zoo", "--dtype", "float32"], "--dtype"),
        (["--members", "deep8"], "--members"),  # no --zoo: the default model's report
        (["--api", "--text-n", "5"], "--text-n"),
        (["--jobs", "1"], "--jobs"),
        (["--zoo", "--rows", "vlcache (defaults)"], "--rows"),  # rows are ablation rows
    ],
)
def test_a_flag_the_mode_ignores_is_refused_by_name(argv, named, capsys, monkeypatch):
    import vlkv_lab.eval.zoo as zoo

    monkeypatch.setattr(zoo, "run_zoo", lambda args: pytest.fail("the run started"))
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlkv eval: ") and named in err


def test_flags_of_the_mode_pass_the_check():
    import argparse

    from vlkv_lab.eval.command import add_eval_parser, misplaced_flags

    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers())
    parse = parser.parse_args
    for argv in (
        ["eval", "--zoo", "--ablation", "--members", "text", "--text-n", "5", "--jobs", "1", "--rows", "x"],
        [
            "eval",
            "--api",
            "--member",
            "text:needle",
            "--budgets",
            "0.02",
            "--concurrency",
            "1",
            "--dtype",
            "float32",
        ],
        ["eval", "--api", "--batch-invariant", "--compression-profile", "p.json"],
        ["eval", "--zoo", "--api", "--members", "default"],
        ["eval", "--policy", "snapkv", "--budget", "0.05", "-n", "10"],
        ["eval", "--zoo", "--budgets", "0.1,0.05"],  # the default value, typed out: nothing is lost
        ["eval", "--protocol", "a.json", "b.json"],
    ):
        assert misplaced_flags(parse(argv)) == "", argv
