"""``graphfeed-train``'s command line without a graph to train: the flags it refuses and
how, list flags in either form, devices and process groups this machine lacks, the
channels' security it leaves as it found it, and servers nobody runs."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from protos.security import Security, default_security, set_default_security
from trainer_client import train
from trainer_client.ddp import CHECKPOINT_NAME
from trainer_client.evaluate import evaluation_mode
from trainer_client.loop import sampled_fanouts
from trainer_client.train import main


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("device", "message"), [
    ("cuda", "--device cuda: CUDA is not available here"),
    ("cuda:3", "--device cuda:3: CUDA is not available here"),
    ("tpu", "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
])
def test_a_device_this_machine_lacks_is_a_plain_error(
    device: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("this machine has CUDA")
    assert main(["--servers", "127.0.0.1:1", "--device", device, "--timeout", "1"]) == 1
    assert message in caplog.text


def test_main_leaves_the_callers_default_security_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """main() sets the channels' default security for its run and restores it after, so
    that later loaders in the same process read theirs (the environment, or their own)."""
    for name in ("GRAPHFEED_TLS_CA", "GRAPHFEED_TOKEN", "GRAPHFEED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--servers", "127.0.0.1:1", "--timeout", "0.5", "--device", "cpu"]) == 1
    monkeypatch.setenv("GRAPHFEED_TOKEN", "from-the-environment")
    assert default_security().token == "from-the-environment"
    own = Security(token="own")
    set_default_security(own)
    try:
        assert main(["--servers", "127.0.0.1:1", "--timeout", "0.5", "--device", "cpu"]) == 1
        assert default_security() is own
    finally:
        set_default_security(None)


@pytest.mark.parametrize(("args", "message"), [
    (["--dist-backend", "mpi"], "--dist-backend: invalid choice: 'mpi'"),
    (["--device", "cpu", "--dist-backend", "nccl"],
     "--dist-backend nccl: expected a CUDA --device, got 'cpu'; use gloo on the CPU"),
])
def test_a_bad_dist_backend_is_a_plain_error(args: list[str], message: str,
                                            caplog: pytest.LogCaptureFixture,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["--servers", "127.0.0.1:1", "--timeout", "1", *args])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code not in (0, None)
    assert message in caplog.text + capsys.readouterr().err


def test_gloo_on_the_cpu_is_what_auto_picks() -> None:
    from trainer_client.ddp import setup_distributed

    env = setup_distributed("cpu", 1.0, "auto")  # one rank: no process group is started
    assert env.backend == "" and env.comm_device == torch.device("cpu")
    with pytest.raises(ValueError, match="--dist-backend: expected one of auto, nccl, gloo, got 'x'"):
        setup_distributed("cpu", 1.0, "x")


def test_unreachable_servers_end_the_run_with_a_clear_error(
        caplog: pytest.LogCaptureFixture, reserve_ports: Callable[[int], list[int]]) -> None:
    address = f"127.0.0.1:{reserve_ports(1)[0]}"  # held: nothing listens there
    assert main(["--servers", address, "--timeout", "1", "--device", "cpu"]) == 1
    assert f"server {address}: no ClusterInfo within 1 s (--timeout" in caplog.text
    caplog.clear()
    assert main(["--servers", address, "--timeout", "60", "--refused-grace", "0.5", "--device", "cpu"]) == 1
    assert f"is a server running at {address}? Start it with graphfeed-server" in caplog.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fanouts", "5,x"], "expected comma-separated integers"),
        (["--fanouts", "5,-3"], "--fanouts: expected fanouts >= -1"),
        (["--fanouts", "0,5"], "--fanouts: a fanout of 0 at hop 1 samples no neighbors there, so no later "
                               "hop samples any either (got 0,5); -1 draws every neighbor"),
        (["--fanouts", "5,0"], "--fanouts: a fanout of 0 at hop 2 samples no neighbors there, so no later "
                               "hop samples any either (got 5,0); use --fanouts 5 (with --layers 2 for as "
                               "many layers)"),
        (["--eval-fanouts", "4,0"], "--eval-fanouts: a fanout of 0 at hop 2"),
        (["--batch-size", "0"], "expected a value > 0"),
        (["--resume"], "--resume: expected --checkpoint-dir too"),
        (["--checkpoint-every", "5"], "--checkpoint-every: expected --checkpoint-dir too"),
        (["--checkpoint-every", "-1"], "--checkpoint-every: expected a number of steps >= 0, got -1"),
        (["--model", "mlp"], "invalid choice: 'mlp'"),
        (["--refused-grace", "0"], "expected a value > 0"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--servers", "127.0.0.1:1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("form", ["separate", "joined"])
def test_list_flags_take_negative_fanouts_in_either_form(form: str) -> None:
    """-1 is every neighbor: ``--fanouts -1,-1`` reads as ``--fanouts=-1,-1``."""
    def flag(name: str, value: str) -> list[str]:
        return [name, value] if form == "separate" else [f"{name}={value}"]

    args = train.parse_args(["--servers", "h:1", *flag("--fanouts", "-1,-1"),
                             *flag("--eval-fanouts", "-1,5")])
    assert args.fanouts == [-1, -1] and args.eval_fanouts == [-1, 5] and args.layers == 2
    assert train.parse_args(["--servers", "h:1", *flag("--fanouts", "-1")]).fanouts == [-1]
    # a value that is no list stays a flag of its own, for argparse to refuse
    with pytest.raises(SystemExit):
        train.parse_args(["--servers", "h:1", "--fanouts", "--epochs", "3"])
    assert train.joined_list_values(["--fanouts", "-1,-1", "--", "--fanouts", "-1,-1"]) == \
        ["--fanouts=-1,-1", "--", "--fanouts", "-1,-1"]


def test_ctrl_c_says_what_was_saved_and_how_to_continue(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """An interrupted run ends with exit status 130 and one line: nothing saved without
    --checkpoint-dir (and how to make --resume possible), nothing saved yet, or the last
    checkpoint's epoch and path; each with the command that continues the run."""
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "partition_dir_task", interrupted)
    argv = ["--partition-dir", str(tmp_path / "parts"), "--device", "cpu", "--epochs", "3"]
    ckpt = tmp_path / "ck pt"  # a path that the command must quote
    for extra, says in (
            ([], "interrupted: nothing saved (no --checkpoint-dir: pass one to continue a run with "
                 "--resume)"),
            (["--checkpoint-dir", str(ckpt)], f"interrupted: nothing saved yet in {ckpt}; continue with: "
                                              f"graphfeed-train {shlex.join(argv)} --checkpoint-dir '{ckpt}' "
                                              "--resume"),
            (["--checkpoint-dir", str(ckpt), "--resume"],
             f"interrupted: saved epoch 4 in {ckpt / CHECKPOINT_NAME}; continue with: graphfeed-train "
             f"{shlex.join(argv)} --checkpoint-dir '{ckpt}' --resume")):
        if "--resume" in extra:
            ckpt.mkdir()
            torch.save({"epoch": 4, "model": {}}, ckpt / CHECKPOINT_NAME)
        caplog.clear()
        assert main([*argv, *extra]) == 130
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert lines == [says]


def test_help_says_the_evaluation_of_each_task() -> None:
    """``--eval``'s default for each task and kind (layer-wise from the servers, sampled in
    process); ``--eval-fanouts`` alone keeps choosing as it did; conflicts are refused."""
    text = " ".join(train.build_parser().format_help().split())
    assert "layerwise from --servers for --task node and --task link, plain and typed; sampled with " \
        "--partition-dir" in text
    link = train.parse_args(["--servers", "h:1", "--task", "link", "--fanouts", "7,3"])
    assert sampled_fanouts(link) == [7, 3] and evaluation_mode(link, "link", typed=False) == "layerwise"
    for flags, task, typed, mode in ((["--eval-fanouts", "full"], "node", False, "layerwise"),
                                     (["--eval-fanouts", "full"], "node", True, "sampled"),
                                     (["--eval-fanouts", "4,2"], "node", False, "sampled"),
                                     (["--eval", "sampled"], "link", True, "sampled")):
        args = train.parse_args(["--servers", "h:1", *flags])
        assert evaluation_mode(args, task, typed) == mode, flags
    assert evaluation_mode(train.parse_args(["--partition-dir", "d"]), "node", False) == "sampled"
    for refused in (["--servers", "h:1", "--eval", "layerwise", "--eval-fanouts", "4,2"],
                    ["--partition-dir", "d", "--eval", "layerwise"]):
        with pytest.raises(SystemExit):
            train.parse_args(refused)
