"""Foreign run folders, checkpoints and configs do not run code.

Each attack is made as an attacker would make it: a checkpoint whose pickle runs code
(its size and CRC-32 recomputed into ``meta.json``, as a tampered run folder would have
them), and a run folder or ``--config`` file owned by another user naming
``os:system`` as the model. What each would run writes a marker file: it must never
appear, and the refusal is one line naming what was refused and the fix. An ordinary run
folder of this user still evaluates and resumes exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch

from conftest import run_main

NOBODY = 65534
SMALL = ["--strategy", "single", "--workers", "1", "--model", "mlp", "--data", "synthetic", "--samples", "64",
         "--input-shape", "1x8x8", "--batch-size", "8", "--no-progress", "--checkpoint-every", "2"]


class RunsCode:
    """An object whose unpickling runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run of this user: 4 iterations, checkpoints at 2 and 4, model.pt."""
    run = tmp_path_factory.mktemp("own") / "run"
    result = run_main("train", *SMALL, "--iterations", "4", "--out", str(run))
    assert result.returncode == 0, result.stderr
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def plant_pickle(checkpoint: Path, marker: Path) -> None:
    """Replace rank 0's file of ``checkpoint`` by a pickle that runs code, and record its
    size and CRC-32 in meta.json (as the checkpoint files compute them)."""
    file = checkpoint / "rank-0.pt"
    torch.save({"model": RunsCode(marker), "train": {"iteration": 2}}, file)
    data = file.read_bytes()
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["ranks"][0].update(bytes=len(data), crc32=zlib.crc32(data))
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def make_foreign(run: Path, marker: Path) -> None:
    """The run's config names ``os:system`` as its model, and the folder is nobody's."""
    toml = run / "config.toml"
    text = "".join(line + "\n" for line in toml.read_text().splitlines()
                   if not line.startswith(("model =", "model-args =")))
    toml.write_text(f'model = "os:system"\nmodel-args = \'command="touch {marker}"\'\n' + text)
    for path in [run, *run.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


def one_line_refusal(result, *words: str) -> str:
    assert result.returncode != 0, result
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shmtrain: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to nobody needs root")


# -- checkpoints are not unpickled ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_checkpoint_that_runs_code_is_refused_by_evaluate(finished: Path, tmp_path: Path) -> None:
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    plant_pickle(run / "checkpoints" / "step-4", marker)
    result = run_main("evaluate", str(run / "checkpoints" / "latest"))
    assert not marker.exists()
    one_line_refusal(result, "rank-0.pt", "weights_only")


@pytest.mark.timeout(60)
def test_a_checkpoint_that_runs_code_is_refused_by_resume(finished: Path, tmp_path: Path) -> None:
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    plant_pickle(run / "checkpoints" / "step-4", marker)
    result = run_main("train", "--resume", str(run), "--iterations", "6")
    assert not marker.exists()
    one_line_refusal(result, "rank-0.pt", "weights_only")
    assert (run / "checkpoints" / "step-4").is_dir()  # refused, not moved aside as damaged


@pytest.mark.timeout(60)
def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(finished: Path, tmp_path: Path) -> None:
    """A checkpoint written before checkpoints loaded with weights_only (meta.json format 1,
    numpy's RNG state pickled as numpy objects) is refused, with what to do."""
    run = copy_of(finished, tmp_path)
    point = run / "checkpoints" / "step-4"
    state = torch.load(point / "rank-0.pt", weights_only=True)
    import numpy as np

    state["train"]["rng"]["numpy"] = np.random.get_state()  # as the previous version saved it
    torch.save(state, point / "rank-0.pt")
    data = (point / "rank-0.pt").read_bytes()
    meta = json.loads((point / "meta.json").read_text())
    meta["format"] = 1
    meta["ranks"][0].update(bytes=len(data), crc32=zlib.crc32(data))
    (point / "meta.json").write_text(json.dumps(meta))
    for words in (["evaluate", str(point)], ["train", "--resume", str(run), "--iterations", "6"]):
        one_line_refusal(run_main(*words), "step-4", "format 1", "new run")


@pytest.mark.timeout(30)
def test_checkpoints_load_with_weights_only(finished: Path) -> None:
    for file in (finished / "checkpoints").glob("step-*/rank-*.pt"):
        state = torch.load(file, weights_only=True)
        assert set(state["train"]["rng"]) >= {"torch", "numpy", "python"}
    torch.load(finished / "model.pt", weights_only=True)


@pytest.mark.timeout(30)
def test_a_state_that_would_need_unpickling_is_refused_when_saved(tmp_path: Path) -> None:
    import numpy as np

    from shmtrain.runtime.checkpoint.files import CheckpointError, save_file

    with pytest.raises(CheckpointError, match=r"state\['strategy'\]\['words'\]: it is a numpy.ndarray"):
        save_file({"strategy": {"words": np.zeros(3)}}, tmp_path / "rank-0.pt")
    assert not list(tmp_path.iterdir())  # refused before anything is written


# -- a config of another user does not run a command ---------------------------------------------
@needs_root
@pytest.mark.timeout(60)
def test_a_run_folder_of_another_user_is_refused(finished: Path, tmp_path: Path) -> None:
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    make_foreign(run, marker)
    for words in (["evaluate", str(run)], ["evaluate", str(run / "checkpoints" / "latest")],
                  ["train", "--resume", str(run), "--iterations", "6"], ["compare", str(run)]):
        result = run_main(*words)
        assert not marker.exists(), words
        one_line_refusal(result, str(run), "nobody", "SHMTRAIN_TRUSTED")


@needs_root
@pytest.mark.timeout(60)
def test_a_config_file_of_another_user_is_refused(tmp_path: Path) -> None:
    marker, config = tmp_path / "ran", tmp_path / "run.toml"
    config.write_text(f'model = "os:system"\nmodel-args = \'command="touch {marker}"\'\n')
    os.chown(config, NOBODY, NOBODY)
    flags = [word for word in SMALL if word not in ("--model", "mlp")]  # the config's model
    result = run_main("train", "--config", str(config), *flags, "--iterations", "2", "--out", str(tmp_path / "r"))
    assert not marker.exists()
    one_line_refusal(result, "--config", str(config), "nobody", "SHMTRAIN_TRUSTED")
    config.chmod(0o666)
    os.chown(config, os.geteuid(), os.getegid())  # this user's, but every user can write it
    result = run_main("train", "--config", str(config), *flags, "--iterations", "2", "--out", str(tmp_path / "r"))
    assert not marker.exists()
    one_line_refusal(result, "--config", "every user can write it", "SHMTRAIN_TRUSTED")


@needs_root
@pytest.mark.timeout(60)
def test_a_trusted_folder_still_does_not_call_a_standard_library_function(
        finished: Path, tmp_path: Path, monkeypatch) -> None:
    run, marker = copy_of(finished, tmp_path), tmp_path / "ran"
    make_foreign(run, marker)
    monkeypatch.setenv("SHMTRAIN_TRUSTED", str(run))
    result = run_main("evaluate", str(run))
    assert not marker.exists()
    one_line_refusal(result, "--model 'os:system'", "standard library")


@pytest.mark.timeout(30)
def test_module_callables_of_the_standard_library_are_refused_before_import() -> None:
    from shmtrain.models.user import resolve_callable

    for spec in ("os:system", "builtins:exec", "subprocess:run", "antigravity:fly"):
        with pytest.raises(ValueError, match="standard library"):
            resolve_callable(spec)
    assert "antigravity" not in sys.modules  # refused by name: importing it opens a web browser
    assert callable(resolve_callable("support.odd_models:fixed"))


# -- this user's run folder works as before ------------------------------------------------------
@pytest.mark.timeout(60)
def test_an_own_run_folder_evaluates_and_resumes_exactly(finished: Path, tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    for target in (run, run / "checkpoints" / "latest"):
        result = run_main("evaluate", str(target))
        assert result.returncode == 0, result.stderr
    shutil.rmtree(run / "checkpoints" / "step-4")
    (run / "model.pt").unlink()
    result = run_main("train", "--resume", str(run), "--iterations", "4")
    assert result.returncode == 0, result.stderr
    resumed = torch.load(run / "model.pt", weights_only=True)
    straight = torch.load(finished / "model.pt", weights_only=True)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    compared = run_main("compare", str(run), str(finished), "--out", str(tmp_path / "c.png"))
    assert compared.returncode == 0, compared.stderr
