"""Typed errors: each carries what the user needs to act; the CLI maps them to exit codes."""


class AttnExportError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 2


class UsageError(AttnExportError):
    """Bad input: an unknown name, an option the variant does not take, a bad value or path."""


class UnknownVariantError(UsageError):
    pass


class GoldenIntegrityError(AttnExportError):
    """A golden file is missing or its sha256 does not match the manifest."""


class ExportError(AttnExportError):
    """The export ran but its result is not what was asked for (e.g. no fused op)."""

    exit_code = 1


class UnsupportedByFlavor(ExportError):
    """The options ask for something the flavour's fused op cannot express (e.g. weights)."""


class ProviderUnavailableError(AttnExportError):
    """A runtime that was asked for cannot run here; the message says why."""



def first_line(e: BaseException) -> str:
    """The first line of an exception's message (a reason said in one line); "" for none."""
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def reason(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {first_line(e)}"
