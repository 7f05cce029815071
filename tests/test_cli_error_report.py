"""How a failure is reported (dist/errors.py): its message made one line for the `error: ...` line torchrun's
summary shows, and an error file that cannot be written leaving that report alone."""


def test_one_line_drops_blank_and_whitespace_only_lines_instead_of_doubling_spaces():
    """A message with blank lines (a simulator's error, load_state_dict's header and tab-indented lines) is one line
    with single spaces between its non-blank lines and none at the ends: an empty line kept as '' joined to a double
    space, and a trailing one to a trailing space, on the `error: ...` line torchrun's summary shows."""
    from dist.errors import one_line
    message = "Error(s) in loading state_dict for ActorCritic:\n\n\tsize mismatch for w: shape [3] vs [4].\n  \n"
    assert one_line(RuntimeError(message)) == ("Error(s) in loading state_dict for ActorCritic: size mismatch for w: "
                                               "shape [3] vs [4].")


def test_an_error_file_that_cannot_be_written_leaves_the_failure_report_alone(tmp_path, monkeypatch):
    """tell_torchrun runs while cli() reports a failure: an error file it cannot write (a directory gone, a full disk)
    must not raise from there, which would replace the failure being reported with an OSError about the file."""
    from dist.errors import tell_torchrun
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "error.json"))
    tell_torchrun("error: could not write x", after_peer=True)       # returns, raising nothing
    assert list(tmp_path.iterdir()) == []
