"""ContextBook: per-request contexts synced by (keep, delta) updates."""

from __future__ import annotations

from spin.rpc.contexts import ContextBook


def test_new_request_with_keep_zero() -> None:
    book = ContextBook()
    assert len(book) == 0 and "a" not in book
    assert book.apply("a", 0, [1, 2, 3]) == (1, 2, 3)
    assert "a" in book and len(book) == 1
    assert book.apply("b", 0, ()) == ()  # an empty context is held, not a resync
    assert "b" in book and len(book) == 2


def test_keep_zero_on_known_request_replaces_context() -> None:
    book = ContextBook()
    book.apply("a", 0, [1, 2, 3])
    assert book.apply("a", 0, [9]) == (9,)
    assert book.apply("a", 1, [8]) == (9, 8)


def test_keep_on_unknown_request_is_resync() -> None:
    book = ContextBook()
    assert book.apply("ghost", 1, [5]) is None
    assert book.apply("ghost", 3, []) is None
    assert "ghost" not in book and len(book) == 0


def test_keep_beyond_held_is_resync_and_leaves_context() -> None:
    book = ContextBook()
    book.apply("a", 0, [1, 2, 3])
    assert book.apply("a", 4, [7]) is None
    assert book.apply("a", 3, [4]) == (1, 2, 3, 4)  # the held context was left as it was


def test_negative_keep_is_resync() -> None:
    book = ContextBook()
    book.apply("a", 0, [1, 2])
    assert book.apply("a", -1, [3]) is None
    assert book.apply("new", -1, [3]) is None and "new" not in book


def test_keep_all_appends_delta() -> None:
    book = ContextBook()
    book.apply("a", 0, [1, 2])
    assert book.apply("a", 2, [3, 4]) == (1, 2, 3, 4)
    assert book.apply("a", 4, []) == (1, 2, 3, 4)


def test_keep_truncates_stale_tail() -> None:
    """Tokens after ``keep`` (drafted or stale) are dropped before the delta goes on."""
    book = ContextBook()
    book.apply("a", 0, [1, 2, 3, 4, 5])
    assert book.apply("a", 2, [9]) == (1, 2, 9)
    assert book.apply("a", 3, []) == (1, 2, 9)
    assert book.apply("a", 4, []) is None  # the dropped tail is really gone
    assert book.apply("a", 1, []) == (1,)


def test_extend_appends_own_tokens() -> None:
    book = ContextBook()
    book.apply("a", 0, [1, 2])
    book.extend("a", [3])
    book.extend("a", (4, 5))
    book.extend("a", [])
    assert book.apply("a", 5, []) == (1, 2, 3, 4, 5)
    assert book.apply("a", 6, []) is None


def test_apply_returns_a_snapshot() -> None:
    """The returned tuple does not change when the book is extended later."""
    book = ContextBook()
    ctx = book.apply("a", 0, [1, 2])
    book.extend("a", [3])
    assert ctx == (1, 2)
    delta = [7, 8]
    book.apply("b", 0, delta)
    delta.append(9)  # the caller's list is not aliased
    assert book.apply("b", 2, []) == (7, 8)
    assert book.apply("b", 3, []) is None


def test_release() -> None:
    book = ContextBook()
    book.apply("a", 0, [1])
    book.apply("b", 0, [2])
    assert book.release("a") is True
    assert "a" not in book and len(book) == 1
    assert book.release("a") is False
    assert book.release("never") is False
    assert book.apply("a", 1, []) is None  # released: a keep now needs a resync
    assert book.apply("b", 1, [3]) == (2, 3)
