"""`vlkv eval` is one program per subcommand, each taking only the flags it reads: a flag of another program
is refused by name before a model loads, the one-mode spellings name the program that replaced them, and each
program's handler gets every flag it reads."""

from __future__ import annotations

import pytest
from vlkv.deploy.cli.main import main


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["zoo", "--members", "text", "--budgets", "0.02,0.05"], "--budgets"),  # the zoo runs 1, 2, 5, 10%
        (["zoo", "--api", "--concurrency", "2"], "--concurrency"),  # the zoo's --api ignores it
        (["zoo", "--dtype", "float32"], "--dtype"),
        (["--members=deep8"], "--members"),  # the default model's report has no members
        (["api", "--text-n", "5"], "--text-n"),
        (["--jobs=1"], "--jobs"),
        (["table", "--policy", "snapkv"], "--policy"),  # the table sweeps every policy
        (["protocol", "a.json", "--members", "x"], "--members"),
    ],
)
def test_a_flag_of_another_program_is_refused_by_name(argv, named, capsys, monkeypatch):
    import vlkv_lab.eval.zoo as zoo

    monkeypatch.setattr(zoo, "run_zoo", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("old", "program"),
    [(["--zoo", "--members", "text"], "zoo"), (["--table"], "table"), (["--protocol", "a.json"], "protocol")],
)
def test_the_one_mode_spelling_names_its_program(old, program, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *old])
    assert exit_.value.code == 2 and f"vlkv eval {program}" in capsys.readouterr().err


def test_rows_without_ablation_is_refused(capsys):
    assert main(["eval", "zoo", "--rows", "vlcache (defaults)"]) == 2
    assert "--rows" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "mode", "handler"),
    [
        (
            ["zoo", "--ablation", "--members", "text", "--text-n", "5", "--jobs", "1", "--rows", "x"],
            "zoo",
            "run_zoo",
        ),
        (
            ["api", "--member", "text:needle", "--budgets", "0.02", "--concurrency", "1"],
            "api",
            "run_api_check",
        ),
        (["api", "--batch-invariant", "--compression-profile", "p.json"], "api", "run_api_check"),
        (["zoo", "--api", "--members", "default"], "zoo", "run_zoo"),
        (["--policy", "snapkv", "--budget", "0.05", "-n", "10"], "", "run_eval"),
        (["table", "--kv-dtype", "int8"], "table", "run_eval"),
        (["protocol", "a.json", "b.json"], "protocol", "run_protocol"),
    ],
)
def test_each_program_reaches_its_handler_with_every_flag_it_reads(argv, mode, handler, monkeypatch):
    import vlkv_lab.eval.api_check as api_check
    import vlkv_lab.eval.protocol as protocol
    import vlkv_lab.eval.report as report
    import vlkv_lab.eval.zoo as zoo
    from vlkv_lab.eval.command import _defaults

    seen = {}
    for module, name in (
        (zoo, "run_zoo"),
        (api_check, "run_api_check"),
        (report, "run_eval"),
        (protocol, "run_protocol"),
    ):
        monkeypatch.setattr(module, name, lambda args, name=name: seen.setdefault(name, args) and 0)
    assert main(["eval", *argv]) == 0
    (got,) = seen.items()
    assert got[0] == handler
    args = got[1]
    assert args.mode == mode and set(_defaults()) <= set(vars(args))
