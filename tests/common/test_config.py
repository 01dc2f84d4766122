import pytest

from common.config import DEFAULT_LOOKAHEAD, resolve_lookahead


@pytest.mark.parametrize(
    ("cached", "device", "expected"),
    [
        (True, "cuda", DEFAULT_LOOKAHEAD),
        (True, "cuda:1", DEFAULT_LOOKAHEAD),
        (True, "cpu", 0),
        (False, "cuda", 0),
    ],
)
def test_lookahead_defaults_on_only_with_a_cache_on_cuda(tmp_path, cached, device, expected) -> None:
    assert resolve_lookahead(str(tmp_path), cached, None, device) == expected


def test_a_given_lookahead_is_checked_not_replaced(tmp_path) -> None:
    assert resolve_lookahead(str(tmp_path), True, 0, "cuda") == 0
    assert resolve_lookahead(str(tmp_path), True, 7, "cpu") == 7
    with pytest.raises(ValueError, match="below 0"):
        resolve_lookahead(str(tmp_path), True, -1, "cuda")
    with pytest.raises(ValueError, match="give --expert-cache"):
        resolve_lookahead(str(tmp_path), False, 2, "cuda")
