"""Types of serving/gateway/_fastwire.c (the native twin of wire.py's walk)."""

def columns(
    buf: bytes, max_features: int, dense_width: int = -1, max_ids: int = -1, /
) -> int | tuple[int, int, int, str, list[str], bytes, bytes, bytes, bytes, bool] | None: ...
def impressions(
    head: bytes, mid: bytes, dense: object, values: object, lengths: object, scores: object, /
) -> tuple[bytes, list[int]]: ...
