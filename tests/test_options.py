"""Options: every public call spells its options out, and checks them where they are given."""


import numpy as np
import pytest
from builders import train_state

import zarrckpt


@pytest.mark.parametrize("options, error, message", [
    ({"max_inflight_byte": 2**20}, TypeError, "unexpected keyword argument 'max_inflight_byte'"),
    ({"max_inflight_bytes": 0}, ValueError, "option max_inflight_bytes must be positive"),
    ({"keep_last": 0}, ValueError, "option keep_last must be positive"),
    ({"keep_last": "3"}, TypeError, "option keep_last must be an int"),
    ({"async_save": "yes"}, TypeError, "option async_save must be True or False"),
    ({"max_staged_bytes": -1}, ValueError, "option max_staged_bytes must be positive"),
    ({"timeout_s": "60"}, TypeError, "option timeout_s must be a number"),
    ({"save_interval_steps": 2.5}, TypeError, "option save_interval_steps must be an int"),
    ({"storage_options": "anon"}, TypeError, "storage_options must be a dict"),
    ({"best_mode": "lowest"}, ValueError, "best_mode must be 'min' or 'max'"),
    ({"keep_best": 2}, ValueError, "keep_best needs best_metric"),
])
def test_manager_options_are_checked_at_construction(tmp_path, options, error, message):
    with pytest.raises(error, match=message):
        zarrckpt.CheckpointManager(str(tmp_path), **options)
    assert not any(tmp_path.iterdir())  # nothing was written, no lease left


def test_the_managers_byte_bound_is_max_inflight_bytes_and_the_old_name_still_works(tmp_path):
    """The manager names its bound on staged bytes as every other call does;
    `max_staged_bytes`, its name before, is taken with a DeprecationWarning naming the
    new one, and both at once is an error naming both."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with zarrckpt.CheckpointManager(str(tmp_path / "new"), max_inflight_bytes=2**20) as mgr:
            assert mgr._save_options.max_inflight_bytes == 2**20
    with pytest.warns(DeprecationWarning, match="max_inflight_bytes"):
        with zarrckpt.CheckpointManager(str(tmp_path / "old"), max_staged_bytes=2**21) as mgr:
            assert mgr._save_options.max_inflight_bytes == 2**21
    with pytest.raises(TypeError, match="max_inflight_bytes.*max_staged_bytes"):
        zarrckpt.CheckpointManager(str(tmp_path / "both"), max_inflight_bytes=2**20, max_staged_bytes=2**20)


def test_results_name_one_thing_one_way_and_the_old_names_still_work(tmp_path):
    """Every result says where it landed as `url` and what it holds as `leaves`; the
    names before (`ExportResult.path`, `.arrays`, `CopyResult.destination`) still read,
    with a DeprecationWarning."""
    url = str(tmp_path / "ckpt")
    zarrckpt.save_pytree(url, {"w": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float32)})
    exported = zarrckpt.export_checkpoint(url, str(tmp_path / "model.safetensors"))
    copied = zarrckpt.copy_checkpoint(url, str(tmp_path / "copy"))
    imported = zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(tmp_path / "imported"))
    assert exported.url == str(tmp_path / "model.safetensors") and copied.url == str(tmp_path / "copy")
    assert exported.leaves == imported.leaves == 2
    for result, old, new in ((exported, "path", "url"), (exported, "arrays", "leaves"),
                             (copied, "destination", "url")):
        with pytest.warns(DeprecationWarning, match=f"{type(result).__name__}.{new}"):
            assert getattr(result, old) == getattr(result, new)


def test_function_options_are_checked_at_the_call(tmp_path):
    url = str(tmp_path)
    with pytest.raises(TypeError, match=r"save_checkpoint\(\) got an unexpected keyword argument 'max_inflight_byte'"):
        zarrckpt.save_checkpoint(url, 1, train_state(), max_inflight_byte=10)
    with pytest.raises(TypeError, match="option max_chunk_bytes must be an int"):
        zarrckpt.save_checkpoint(url, 1, train_state(), max_chunk_bytes="64MiB")
    zarrckpt.save_checkpoint(url, 1, train_state())
    with pytest.raises(TypeError,
                       match=r"load_checkpoint_if_it_exists\(\) got an unexpected keyword argument 'donate'"):
        zarrckpt.load_checkpoint_if_it_exists(url, train_state(), donate=True)
    with pytest.raises(TypeError, match="option partial must be True or False"):
        zarrckpt.load_checkpoint_if_it_exists(url, train_state(), partial="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'partial_restore'"):
        zarrckpt.load_pytree(f"{url}/0000000001", train_state(), partial_restore=True)
    with zarrckpt.CheckpointManager(url) as mgr:
        with pytest.raises(TypeError, match=r"restore\(\) got an unexpected keyword argument 'strict'"):
            mgr.restore(train_state(), strict=False)
        with pytest.raises(ValueError, match="step must be a non-negative int, got -3"):
            mgr.save(-3, train_state())


def test_an_option_given_under_another_keyword_is_named_by_that_keyword(tmp_path):
    """A call with two sets of storage options, or a step under another name, names the
    keyword the caller wrote, not the one the check was first written for."""
    src = str(tmp_path / "src")
    zarrckpt.save_checkpoint(src, 1, train_state())
    with pytest.raises(TypeError, match=r"^dst_storage_options must be a dict"):
        zarrckpt.copy_checkpoint(f"{src}/0000000001", "memory://copied/x", dst_storage_options="anon")
    with pytest.raises(ValueError, match=r"^src_storage_options\['request_timeout_s'\] must be"):
        zarrckpt.copy_checkpoint(f"{src}/0000000001", "memory://copied/x",
                                 src_storage_options={"request_timeout_s": 0})
    with pytest.raises(ValueError, match="option start_after must be 0 or more, got -1"):
        next(zarrckpt.checkpoints_iterator(src, start_after=-1, timeout_s=0.1))
    with pytest.raises(TypeError, match="option start_after must be an int, got '1'"):
        next(zarrckpt.checkpoints_iterator(src, start_after="1", timeout_s=0.1))


def test_every_public_call_spells_out_its_options():
    """What help() and an IDE show: no **options anywhere in the public API."""
    import inspect

    calls = [getattr(zarrckpt, name) for name in zarrckpt.__all__ if callable(getattr(zarrckpt, name))]
    calls += [getattr(zarrckpt.CheckpointManager, name) for name in dir(zarrckpt.CheckpointManager)
              if not name.startswith("_") and callable(getattr(zarrckpt.CheckpointManager, name))]
    for call in calls:
        if inspect.isclass(call) and issubclass(call, BaseException):
            continue
        kinds = {p.kind for p in inspect.signature(call).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, call


def test_storage_options_on_a_local_path_are_refused_not_ignored(tmp_path):
    """fsspec options do nothing for a path zarrckpt writes itself: a misspelled or
    misplaced one is an error naming it, at the call."""
    url = str(tmp_path / "run")
    for call in (lambda: zarrckpt.CheckpointManager(url, storage_options={"endpoint_ur": "http://x"}),
                 lambda: zarrckpt.save_checkpoint(url, 1, train_state(), storage_options={"anon": True})):
        with pytest.raises(ValueError, match=r"storage_options \['(endpoint_ur|anon)'\] do nothing for the local"):
            call()
    assert not any(tmp_path.iterdir())
    zarrckpt.save_checkpoint(url, 1, train_state(), storage_options={"request_timeout_s": 30})  # zarrckpt's own
    assert zarrckpt.all_steps(url) == [1]
