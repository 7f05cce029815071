"""Gaps found by a mutation audit of dist/comm.py, dist/log_root.py and ppo/export.py: each test below fails on a
hand-made mutation that every earlier test let through. Expected values are written by hand (messages, byte counts
of UTF-8 names, probe names from a fixed random draw, the files an export writes), never read back from the code.

147 mutants (65 comm, 28 log_root, 54 export): 106 killed by the earlier tests (25 of them only by the slow gloo
tests, L22 only when the random probe number's top bit is set, E25 only by hanging the FIFO test), 35 pinned here,
6 left. Pinned: isend/irecv failing when posted named as such; a failed header receive named "a message header" and
uncounted; a backend ValueError and a message opening with a blank line; gather's buffer on the sent tensor's
device; point-to-point calls in the group passed, not use_group's; --root named when empty and below /dev/null (also
the exact message); NAME_MAX and PATH_MAX counted in UTF-8 bytes, a relative root measured as given and its nearest
directory absolute; an OSError without strerror still a refusal; the probe's int64 number (halved, never 0), place
and error message; export of a str checkpoint, of a list policy config or a 1-D first weight, of a config without
'env'; the files printed; a dangling symlink output refused; --out below a file; the exporter's log level set and
given back, its LeafSpec warning filtered; onnx missing alone, an exporter without dynamo=; /dev/null as CKPT.
Also pinned here, though a slow or hanging test kills them: the probe mutants L21, L22, L25, L27 and E25.

Equivalent or not worth a test: _Work.wait() not returning the backend's result (no caller reads it); the peer-closed
words looked for in the whole message, not its first line (no backend message is known to differ); the long-name
check from the probe's parent (the extra name exists, so fits NAME_MAX); the normalizer's clip written as 10.0
(ObsNormalizer.clip is a class constant, not in the checkpoint); the policy config's lists kept as lists
(build_actor_critic only iterates them); `if clip` for `if clip is not None` (a clip of 0 is refused first)."""

import functools
import logging
import os
import warnings

import pytest
import torch

from dist import comm, log_root
from dist.errors import UsageError
from ppo import export
from tests.test_cli_comm_rules import STALLED, _Failing
from tests.test_export_logger_env_rules import small_checkpoint, torchscript_only  # noqa: F401 (a fixture)

CLOSED = "a peer rank died (its connection closed)"
REFUSED = "the backend refused or failed it"


# ---- dist/comm.py ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["isend", "irecv"])
def test_an_isend_or_irecv_refused_when_posted_names_itself_not_its_blocking_twin(monkeypatch, kind):
    """A non-blocking send or receive can fail when it is posted, not only when waited on: the error names the call
    that was made (isend, irecv), as a failed wait() does, so the log points at the right line of sync/.
    Mutant: `_named("send", ...)` / `_named("recv", ...)` around the posting of isend / irecv."""
    monkeypatch.setattr(comm.torch_dist, kind, _Failing("Connection reset by peer"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 0)
    with pytest.raises(comm.CollectiveError) as caught:
        getattr(comm, kind)(torch.ones(2), "weight_sync", 1)
    assert str(caught.value) == f"{kind} for 'weight_sync' failed on rank 0: {CLOSED} (Connection reset by peer)"


def test_a_failed_header_receive_names_the_header_and_counts_nothing(monkeypatch):
    """recv_then_count learns its purpose from the header it receives: when the receive fails there is no purpose
    yet, so the error says "a message header", and nothing is counted (purpose_of never reads the unfilled tensor).
    Mutant: `_named("recv", "header")`; counting before the receive (under purpose_of of the zeros)."""
    monkeypatch.setattr(comm.torch_dist, "recv", _Failing("Timed out waiting 5000ms for recv operation to complete"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 3)
    monkeypatch.setattr(comm, "LEDGER", type(comm.LEDGER)(comm.LEDGER.default_factory))
    asked = []
    with pytest.raises(comm.CollectiveError) as caught:
        comm.recv_then_count(torch.zeros(1, dtype=torch.int64), lambda t: asked.append(t) or "kind0", src=0)
    assert str(caught.value) == ("recv for 'a message header' failed on rank 3: " + STALLED +
                                 " (Timed out waiting 5000ms for recv operation to complete)")
    assert asked == [] and comm.ledger_snapshot() == {}


def test_a_backend_failure_that_is_not_a_runtime_error_is_named_too(monkeypatch):
    """torch.distributed raises ValueError for arguments it refuses (a rank outside the group, say): it becomes the
    same CollectiveError as a RuntimeError from gloo, naming the call and its purpose, not a bare traceback.
    Mutant: `except RuntimeError` in `_named`."""
    def refused(*args, **kwargs):
        raise ValueError("Invalid destination rank: should be less than 2, but got 5")
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "broadcast", refused)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    with pytest.raises(comm.CollectiveError) as caught:
        comm.broadcast(torch.ones(2), "params", src=5)
    assert str(caught.value) == ("broadcast for 'params' failed on rank 1: " + REFUSED +
                                 " (Invalid destination rank: should be less than 2, but got 5)")
    assert type(caught.value.__cause__) is ValueError


def test_a_backend_message_that_starts_with_a_blank_line_is_read_from_its_first_words(monkeypatch):
    """The first line shown (and read for the cause) is the message's first non-blank one: a message that opens
    with a newline is still a timeout, and says which.
    Mutant: `str(exc).splitlines()[0]` without the `.strip()` (an empty first line: the cause is lost)."""
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "all_reduce", _Failing("\n  Timed out waiting 600000ms\n  at gloo/pair.cc"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 0)
    with pytest.raises(comm.CollectiveError) as caught:
        comm.all_reduce(torch.ones(2), "metrics")
    assert str(caught.value) == f"all_reduce for 'metrics' failed on rank 0: {STALLED} (Timed out waiting 600000ms)"


def test_the_gather_lands_on_the_device_and_dtype_of_what_was_sent(monkeypatch):
    """NCCL gathers into tensors on the GPU the rank sent from: the receiving buffer is made on the sent tensor's
    device with its dtype (here the meta device stands for a GPU: gloo runs on the host alone).
    Mutant: the buffer made without `device=tensor.device` (on the host)."""
    seen = []
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    monkeypatch.setattr(comm.torch_dist, "gather", lambda tensor, gather_list, dst, group: seen.append(gather_list))
    out = comm.gather(torch.empty(3, dtype=torch.int16, device="meta"), "checkpoint", dst=1)
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.int16, (2, 3))
    assert [(t.device.type, tuple(t.shape)) for t in seen[0]] == [("meta", (3,)), ("meta", (3,))]


@pytest.mark.parametrize("name", ["send", "recv", "isend", "irecv", "recv_then_count"])
def test_point_to_point_messages_run_in_the_group_they_are_given_not_use_group_s(monkeypatch, name):
    """A rollout rank runs its collectives in the rollout ranks' group (use_group) but sends batches to a learner,
    which is not in it: a point-to-point call takes the group its caller passes (None: the world), whatever
    use_group set.
    Mutant: `group=_GROUP` in place of `group=group` in send, recv, isend, irecv or recv_then_count."""
    rollout_ranks, given, seen = object(), object(), []
    monkeypatch.setattr(comm, "_GROUP", rollout_ranks)
    monkeypatch.setattr(comm.torch_dist, name.split("_")[0], lambda tensor, **kwargs: seen.append(kwargs["group"]))
    call = getattr(comm, name)
    extra = (lambda t: "batches",) if name == "recv_then_count" else ("batches",)
    peer = {"dst": 1} if "send" in name else {"src": 1}
    call(torch.zeros(1), *extra, **peer)
    call(torch.zeros(1), *extra, **peer, group=given)
    assert seen[0] is None and seen[1] is given


# ---- dist/log_root.py --------------------------------------------------------------------------------------------

def test_an_empty_root_is_named_by_the_flag_it_came_from():
    """A bench's --root "$UNSET" is refused under its own flag, not as --log.root, which the bench has not.
    Mutant: "--log.root is empty" written out in place of `{flag}`."""
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root("", "--root")
    assert str(caught.value) == "--root is empty; pass a directory ('.' for the current one)"


def test_a_root_under_a_device_file_is_not_a_directory_even_when_only_read():
    """/dev/null is no regular file and no directory: a --root below it cannot hold results, also for a bench that
    only reads its table (write=False, where no write probe would catch it). The message names the root, the
    existing path that is not a directory, and the flag to change.
    Mutant: `if os.path.isfile(probe)` for `if not os.path.isdir(probe)`; the message without the path or flag."""
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root("/dev/null/runs", "--root", write=False)
    assert str(caught.value) == "--root '/dev/null/runs': '/dev/null' is a file, not a directory; pick another --root"


def test_a_name_is_measured_in_utf_8_bytes_not_characters(tmp_path):
    """NAME_MAX counts bytes: a name of n 'é' (2 bytes each in UTF-8) with n <= NAME_MAX < 2n is too long for the
    file system, and the message gives its size in bytes.
    Mutant: `len(n)` for `len(n.encode())` in the test, or in the message."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    chars = name_max // 2 + 1
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(str(tmp_path / "runs" / ("é" * chars)), write=False)
    assert str(caught.value) == (f"--log.root: the name {'é' * 16!r}... ({2 * chars} bytes) is longer than the file "
                                 f"system takes ({name_max} bytes a name); use a shorter one")


def deep_relative(length: int, letter: str = "d") -> str:
    """A relative path of `length` UTF-8 bytes: names of 200 bytes ('d', or 100 'é') joined by '/', a shorter last."""
    width = len(letter.encode())
    parts, left = [], length
    while left > 200:
        parts.append(letter * (200 // width))
        left -= 201
    parts.append(letter * (left // width) + "d" * (left % width))
    return "/".join(parts)


def test_the_path_limit_takes_a_relative_root_as_given_and_counts_its_bytes(tmp_path, monkeypatch):
    """The system calls get a relative root relative to the working directory: one of PATH_MAX - 65 bytes is taken
    wherever the test runs (its absolute form is longer). A root of 'é' names of PATH_MAX - 64 bytes, about half as
    many characters, is refused, its size said in bytes. Each root's first folder exists: its nearest existing
    directory is that folder, absolute.
    Mutant: `os.path.abspath(root)` for `os.path.normpath(root)`; `len(...)` of the characters, not the bytes;
    nearest_directory without `os.path.abspath` (a relative answer)."""
    monkeypatch.chdir(tmp_path)
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    taken, accented = deep_relative(path_max - 65), deep_relative(path_max - 64, "é")
    assert (len(taken.encode()), len(accented.encode())) == (path_max - 65, path_max - 64)
    firsts = sorted({taken.split("/")[0], accented.split("/")[0]})
    for first in firsts:
        os.mkdir(first)
    assert log_root.nearest_directory(taken) == str(tmp_path / ("d" * 200))
    log_root.check_writable_root(taken, write=False)
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(accented, write=False)
    assert str(caught.value) == (f"--log.root: the path ({path_max - 64} bytes, plus 64 for the run's directory and "
                                 f"file names) is longer than the file system takes ({path_max} bytes a path); use a "
                                 f"shorter one")
    assert sorted(os.listdir(tmp_path)) == firsts


def test_a_refusal_without_a_strerror_still_refuses(tmp_path, monkeypatch):
    """An OSError raised without an errno has no strerror: the refusal is then its type's name, never "" (which
    reads as "writable" and lets the run fail at its first mkdir after everything was built).
    Mutant: `return exc.strerror` without `or type(exc).__name__`."""
    def refusing(prefix, dir):
        raise OSError()
    monkeypatch.setattr(log_root.tempfile, "mkdtemp", refusing)
    assert log_root.write_refusal(str(tmp_path)) == "OSError"
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(str(tmp_path / "runs"))
    assert str(caught.value) == (f"--log.root {str(tmp_path / 'runs')!r}: {str(tmp_path)!r} is not writable (OSError); "
                                 f"pick a directory you can write to")


@pytest.mark.parametrize("drawn, nonce", [(b"\xff" * 8, 2 ** 63 - 1), (b"\x00" * 8, 1), (b"\x02" + b"\x00" * 7, 1)],
                         ids=["all-ones", "zero", "two"])
def test_the_probe_is_named_by_a_positive_int64_in_the_nearest_existing_directory(tmp_path, monkeypatch, drawn,
                                                                                  nonce):
    """Rank 0 broadcasts the probe's number as one int64, and 0 means "no probe" (a dry run): the 8 random bytes
    (little-endian) are halved into [0, 2**63) and 0 becomes 1. The probe goes in the root's nearest existing
    directory (a first run's --log.root does not exist yet, and is not created), named by 16 hex digits.
    Mutant: without `>> 1` (2**64 - 1 overflows int64); without `or 1`; the probe made inside the root itself."""
    monkeypatch.setattr(log_root.os, "urandom", lambda n: drawn[:n])
    path, made = log_root.make_probe(str(tmp_path / "runs" / "x"))
    assert (path, made) == (str(tmp_path / f".syncppo-probe-{nonce:016x}"), nonce)
    assert os.listdir(tmp_path) == [f".syncppo-probe-{nonce:016x}"] and os.path.isdir(path)
    torch.tensor([made], dtype=torch.int64)     # what agree_on_checkpoint broadcasts


def test_a_probe_that_cannot_be_made_names_the_root_the_probe_and_why(tmp_path, monkeypatch):
    """A --log.root below a file: the error names the root typed, the probe it tried, and the system's reason.
    Mutant: the message without the root, or without `({exc.strerror})`."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(log_root.os, "urandom", lambda n: b"\x02" + b"\x00" * (n - 1))
    root = str(tmp_path / "file" / "runs")
    with pytest.raises(UsageError) as caught:
        log_root.make_probe(root)
    probe = str(tmp_path / "file" / ".syncppo-probe-0000000000000001")
    assert str(caught.value) == (f"--log.root {root!r}: cannot create {probe!r} (Not a directory); pick a directory "
                                 f"you can write to")


# ---- ppo/export.py -----------------------------------------------------------------------------------------------

def test_a_checkpoint_that_is_a_string_is_not_a_train_py_checkpoint(tmp_path):
    """A torch file holding a str that happens to contain the words "model" and "config" passes `in` tests: only the
    dict check turns it into the one-line refusal instead of a TypeError traceback (string indices).
    Mutant: `usable` without `not isinstance(state, dict)`."""
    path = str(tmp_path / "model_1.pt")
    torch.save("model and config", path)
    with pytest.raises(ValueError) as caught:
        export.export(path, str(tmp_path / "out"))
    assert str(caught.value) == (f"CKPT {path!r} is not a train.py checkpoint (it needs 'model' and 'config' "
                                 f"entries)")


@pytest.mark.parametrize("damage, said", [
    ("policy config a list", "AttributeError: 'list' object has no attribute 'items'"),
    ("first layer one-dimensional", "IndexError: tuple index out of range"),
])
def test_a_model_or_policy_config_of_the_wrong_kind_is_one_line(tmp_path, damage, said):
    """A 'policy' config that is a list (no .items()), or an actor's first weight with one dimension (no input
    size): the export says the checkpoint does not fit, naming the error, instead of a traceback.
    Mutant: AttributeError or IndexError left out of load_policy's `except`."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    if damage == "policy config a list":
        state["config"]["policy"] = [8, 8]
    else:
        state["model"]["actor.0.weight"] = torch.zeros(8)
    torch.save(state, path)
    with pytest.raises(ValueError) as caught:
        export.export(path, str(tmp_path / "out"))
    assert str(caught.value) == (f"CKPT {path!r}: its model or policy config does not fit this version's "
                                 f"actor-critic (damaged, or saved by another version?): {said}")
    assert not os.path.exists(tmp_path / "out")


def test_a_config_without_env_settings_exports_with_nothing_to_note(tmp_path, capsys, torchscript_only):
    """A config with no 'env' section (the env's settings are optional to export) means scale 1 and no clip: the
    policy is written and no note about actions printed.
    Mutant: `config["env"]` for `config.get("env", {})`."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    del state["config"]["env"]
    torch.save(state, path)
    written = export.export(path, str(tmp_path / "out"))
    assert written == {"torchscript": str(tmp_path / "out" / "model_3.policy.pt"),
                       "torch.export": str(tmp_path / "out" / "model_3.policy.pt2")}
    assert "note:" not in capsys.readouterr().out


def test_each_file_written_is_printed_with_its_format(tmp_path, capsys, torchscript_only):
    """After the summary line, one line per file: its format and where it went (what a user copies to the robot).
    Mutant: the loop printing `[export] {fmt}: {file}` left out."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert (f"[export] torchscript: {tmp_path}/out/model_3.policy.pt\n"
            f"[export] torch.export: {tmp_path}/out/model_3.policy.pt2\n") in out


def test_a_dangling_symlink_at_an_output_name_is_refused_and_its_target_not_made(tmp_path):
    """A symbolic link to nowhere where STEM.policy.pt goes is not a regular file: written through, the export would
    land wherever the link points. It is refused as a folder of that name is, before anything is written.
    Mutant: `os.path.exists` for `os.path.lexists` (a dangling link does not exist)."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model_3.policy.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(ValueError) as caught:
        export.export(path, str(out))
    assert str(caught.value) == (f"{str(out / 'model_3.policy.pt')!r} is a directory or not a regular file, where the "
                                 f"export writes a file; move it, or pass --out with another folder")
    assert os.listdir(out) == ["model_3.policy.pt"] and not os.path.lexists(tmp_path / "elsewhere.pt")


def test_an_out_below_a_file_is_one_line(tmp_path):
    """--out notes.txt/exported: makedirs fails with NotADirectoryError (not FileExistsError, as for --out notes.txt),
    said as the same one-line refusal with the system's reason.
    Mutant: `except FileExistsError` for `except OSError` around makedirs."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    (tmp_path / "notes.txt").write_text("hello")
    out = str(tmp_path / "notes.txt" / "exported")
    with pytest.raises(ValueError) as caught:
        export.export(path, out)
    assert str(caught.value) == f"--out {out!r} cannot be an output folder (Not a directory)"


def test_the_onnx_exporter_is_quiet_while_it_runs_and_its_log_level_given_back(tmp_path, monkeypatch):
    """The export sets the ONNX exporter's registration logger to ERROR while torch.onnx.export runs (it logs each
    torchvision operator it skips: not installed here, so the level is read inside the call), then restores the
    level it found: a program that exports and then debugs the exporter gets its own setting back.
    Mutant: `registration.setLevel(logging.ERROR)` left out; the `finally` without `registration.setLevel(level)`."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    real, seen = torch.onnx.export, []

    @functools.wraps(real)          # its signature too: onnx_missing reads the exporter's parameters
    def watched(*args, **kwargs):
        seen.append(registration.level)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.onnx, "export", watched)
    before = registration.level
    registration.setLevel(logging.DEBUG)
    try:
        written = export.export(small_checkpoint(tmp_path / "model_3.pt", False), str(tmp_path / "out"))
        assert "onnx" in written and seen == [logging.ERROR] and registration.level == logging.DEBUG
    finally:
        registration.setLevel(before)


def test_the_exporter_s_pytree_deprecation_warning_is_not_passed_on(tmp_path):
    """torch.onnx.export warns (FutureWarning) about torch's own pytree internals (LeafSpec), which no user can act
    on: the export filters it even where every warning is shown.
    Mutant: the LeafSpec filter left out."""
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        written = export.export(path, str(tmp_path / "out"))
    assert "onnx" in written
    assert [str(w.message) for w in shown if "LeafSpec" in str(w.message)] == []


@pytest.mark.parametrize("absent, said", [({"onnx"}, "onnx"), ({"onnx", "onnxscript"}, "onnx, onnxscript")])
def test_onnx_missing_names_each_package_not_installed(monkeypatch, absent, said):
    """ONNX needs both onnx and onnxscript: either one absent is said by name, with the pip line.
    Mutant: only onnxscript looked for."""
    real = export.importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    assert export.onnx_missing() == f"not installed: {said} (pip install onnx onnxscript)"


def test_an_exporter_without_the_dynamo_option_is_not_called(monkeypatch):
    """export() passes dynamo=True: a torch.onnx.export without that parameter (nor the other two) is named as
    lacking each of the three, in the order export() passes them.
    Mutant: "dynamo" left out of EXPORTER_OPTIONS."""
    def old_exporter(model, args, f=None, export_params=True, verbose=False, input_names=None, output_names=None):
        raise AssertionError("called")
    monkeypatch.setattr(torch.onnx, "export", old_exporter)
    assert export.onnx_missing() == (f"torch {torch.__version__}'s torch.onnx.export has no dynamo, dynamic_shapes, "
                                     f"external_data (torch 2.5 or later)")


def test_a_device_given_as_the_checkpoint_is_not_a_regular_file():
    """/dev/null exists and is no directory, but no regular file either: refused as such before it is opened (the
    FIFO test of test_export_inputs.py blocks forever on this mutant instead of failing; a device reads as empty).
    Mutant: the `not os.path.isfile(path)` check left out."""
    with pytest.raises(ValueError) as caught:
        export.export("/dev/null")
    assert str(caught.value) == "CKPT '/dev/null' is not a regular file; pass a model_<iteration>.pt file"
