"""The intent store's errors, one kind each (gthulhu_node/errors.py): what the store and its state file
refuse. Apart from both so the state file (below the store) and the store raise the same classes."""

from __future__ import annotations

from gthulhu_node.errors import Conflict, GthulhuError, LimitExceeded, NotFound
from gthulhu_node.intents.parse import IntentValidationError


class StoreError(GthulhuError):
    """A request the store refuses; the message is for people."""


class StaleGenerationError(StoreError, Conflict):
    """A push whose generation is older than (or conflicts with) the stored one: nothing changed."""


class IntentNotFoundError(StoreError, NotFound):
    """A delete of an intent (or source) the store does not hold."""


class LimitError(StoreError, LimitExceeded):
    """Too many sources (the per-source intent count is an IntentValidationError on `intents`)."""


class StateTooLargeError(LimitError, ValueError):
    """The state would be (or is) larger than STATE_MAX_BYTES."""


class UnencodableError(IntentValidationError):
    """A set holding text that cannot be written as UTF-8 (a lone surrogate): refused before it replaces
    the stored set, since it could be neither saved nor served."""


class NewerStateError(Conflict):
    """The state file was written by a newer agent (a downgrade). Not corrupt: it stays where it is and
    the start fails with this message, so going back to the newer release finds the intents again."""
