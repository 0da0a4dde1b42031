"""What the JSON metadata of every control message may hold: one table, checked on receipt.

`protocol.decode` checks each message's metadata against `SCHEMAS` (by message type, request or
reply) before anything acts on it, so no handler, on a server, the scheduler or a worker, ever
sees a field of the wrong type, a number out of range, an unknown field, metadata on a message
that takes none, or a payload where none belongs. The optimizer and compression settings are
checked by the code that builds them (`tfkv.optim.from_dict`, `tfkv.ps.compression.parse`),
the same rule a config file meets. A message that does not fit raises `SchemaError` naming the
field and what it must be; the receiver answers it with an error and serves on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tfkv.errors import TfkvError
from tfkv.values import MAX_INT, is_integer, is_number

Check = Callable[[Any, str], None]  # raises SchemaError(f"{where} ...") when the value does not fit

MAX_ERROR_TEXT = 4000  # characters of an ERROR's message (protocol.error cuts to it)
_INT = {int}


class SchemaError(TfkvError, ValueError):
    """Metadata that does not fit its message's schema; the text names the field."""


def _fail(where: str, value: Any, what: str) -> None:
    shown = repr(value)
    raise SchemaError(f"{where}={shown[:60]}{'...' if len(shown) > 60 else ''} must be {what}")


def boolean(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        _fail(where, value, "true or false")


def integer(lo: int = 0, hi: int = MAX_INT - 1) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, int) or not is_integer(value) or not lo <= value <= hi:
            _fail(where, value, f"an integer from {lo} to {hi}")
    check.bounds = (lo, hi)  # type: ignore[attr-defined]  # what `array` checks a list of them by at once
    return check


def number(value: Any, where: str) -> None:
    """A finite JSON number (the range is the builder's business)."""
    if not isinstance(value, (int, float)) or not is_number(value):
        _fail(where, value, f"a finite number (an integer one below 2**{MAX_INT.bit_length() - 1})")


def text(max_len: int = 1000, choices: tuple[str, ...] = ()) -> Check:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, str) or len(value) > max_len:
            _fail(where, value, f"a string of at most {max_len} characters")
        if choices and value not in choices:
            _fail(where, value, f"one of {', '.join(choices)}")
    return check


def optional(inner: Check) -> Check:
    def check(value: Any, where: str) -> None:
        if value is not None:
            inner(value, where)
    return check


def array(item: Check, max_len: int = 1 << 16) -> Check:
    """A list of at most `max_len` items, each fitting `item`. A list of integers (a fused
    PUSHPULL's keys: every small key of a step) is checked at once, its type and bounds, and item
    by item only to name the one that does not fit (3.7 us a key on a server, item by item)."""
    bounds = getattr(item, "bounds", None)

    def check(value: Any, where: str) -> None:
        if not isinstance(value, list) or len(value) > max_len:
            _fail(where, value, f"a list of at most {max_len} items")
        if (bounds is not None and value and set(map(type, value)) == _INT  # (bool is not int here)
                and bounds[0] <= min(value) and max(value) <= bounds[1]):
            return
        for i, v in enumerate(value):
            item(v, f"{where}[{i}]")
    return check


def obj(fields: Mapping[str, Check], optional_fields: tuple[str, ...] = ()) -> Check:
    """A JSON object with exactly these fields (those in `optional_fields` may be left out)."""
    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, value, "an object")
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise SchemaError(f"{where}: unknown field(s) {', '.join(map(str, unknown))[:200]}; "
                              f"known: {', '.join(fields)}")
        for name, field_check in fields.items():
            if name in value:
                field_check(value[name], f"{where}.{name}" if where else name)
            elif name not in optional_fields:
                raise SchemaError(f"{where + ': ' if where else ''}field {name!r} is missing")
    return check


def built_by(builder: Callable[[Any], Any]) -> Check:
    """Valid when `builder` accepts it: the optimizer and compression settings are checked by
    the code that makes them from a dict, so the wire and config files meet one rule."""
    def check(value: Any, where: str) -> None:
        try:
            builder(value)
        except (TypeError, ValueError, ArithmeticError) as e:
            raise SchemaError(f"{where}: {e}" if where else str(e)) from None
    return check


@dataclass(frozen=True)
class Schema:
    meta: Check | None = None  # None: the message carries no metadata
    data: str = "none"  # none | required | optional: whether a payload may come with it
    meta_optional: bool = False  # the metadata may also be left out (a plain BARRIER)


def _optimizer(d: Any) -> Any:
    from tfkv import optim

    return optim.from_dict(d)


def _compression(d: Any) -> Any:
    from tfkv.ps import compression

    if not isinstance(d, dict):
        raise ValueError("must be an object")
    kind, threshold = d.get("type"), d.get("threshold", 0.5)
    if not isinstance(kind, str):
        raise ValueError(f"type={kind!r} must be a string")
    number(threshold, "threshold")  # parse() would take "0.5" or crash on null
    if "pull_threshold" in d:
        number(d["pull_threshold"], "pull_threshold")
    return compression.parse(d)


def _sum(text: Any) -> Any:
    from tfkv.ps import sums

    return sums.decode(text)


MAX_FUSED_KEYS = 4096  # keys in one PUSHPULL (a worker sends at most tfkv.ps.worker.MAX_FUSED)
_HOST = text(255)
_PORT = integer(0, 65535)
_ID = integer(0, 65535)  # node ids travel in the header's 16-bit sender field
_RANK = integer(0, 65535)
_PID = integer(0, (1 << 32) - 1)
_STATE = obj({"names": array(text(64), 16), "count": integer()})
_HOLDS = obj({"holds": integer()})
# a worker's error feedback of a key part, kept for worker 0's checkpoint (tfkv.store.dist_feedback)
_FEEDBACK = obj({"rank": _RANK, "what": text(16, ("residual", "velocity"))})
_SUM = obj({"sum": built_by(_sum), "of": integer()})
MAX_TABLE_ROWS = 1 << 40  # rows of one row-sparse key (ids travel as int64; this bounds what a server makes)
MAX_ROW_WIDTH = 1 << 24  # values in one row
# A row-sparse key's shard, made by the server it is on (tfkv.ps.rows): every shard of the key
# gets the same table description and its own index.
_TABLE = obj({"rows": integer(1, MAX_TABLE_ROWS), "width": integer(1, MAX_ROW_WIDTH), "shard": _RANK,
              "shards": integer(1, 65535), "sharding": text(8, ("range", "hash")),
              "init": text(8, ("zeros", "uniform", "normal")), "scale": number, "seed": integer(),
              "dtype": text(8, ("float32", "float16"))}, optional_fields=("dtype",))  # float32 when left out

# The schema of every message, keyed by (type name, is a reply). A type missing from the table
# is never valid in that direction.
SCHEMAS: dict[tuple[str, bool], Schema] = {
    # node <-> scheduler
    ("REGISTER", False): Schema(obj({"role": text(16, ("server", "worker")), "host": _HOST, "port": _PORT,
                                     "rank_hint": optional(_RANK), "pid": _PID, "hostname": _HOST},
                                    optional_fields=("rank_hint",))),
    ("ADDRESS_BOOK", False): Schema(obj({
        "id": _ID, "rank": _RANK, "num_servers": _RANK, "num_workers": _RANK,
        "servers": array(obj({"rank": _RANK, "id": _ID, "host": _HOST, "port": _PORT})),
        "nodes": array(obj({"id": _ID, "role": text(16, ("server", "worker")), "rank": _RANK,
                            "hostname": _HOST, "pid": _PID}))})),
    ("HEARTBEAT", False): Schema(),
    ("HEARTBEAT", True): Schema(),
    # a barrier that also sums every worker's vector (tfkv.ps.sums): a chunk of `of` values
    ("BARRIER", False): Schema(_SUM, meta_optional=True),
    ("BARRIER_DONE", False): Schema(_SUM, meta_optional=True),
    ("DONE", False): Schema(),
    ("SHUTDOWN", False): Schema(),
    ("FAILED", False): Schema(obj({"node": text(200), "reason": text(2000)}, optional_fields=("node",))),
    ("LEFT", False): Schema(obj({"id": _ID, "node": text(200)})),
    # worker -> server
    ("CONFIGURE", False): Schema(obj({"sync": boolean})),
    ("SET_OPTIMIZER", False): Schema(obj({"optimizer": built_by(_optimizer)})),
    ("SET_COMPRESSION", False): Schema(built_by(_compression)),
    # a dense key's part (data), or a row-sparse key's shard (meta: its table), or rows of it
    # (rows frame and data); tfkv.ps.rows refuses an INIT that is none of these
    ("INIT", False): Schema(obj({"table": _TABLE}), data="optional", meta_optional=True),
    ("PUSH", False): Schema(data="required"),
    # a dense pull under both_ways compression: the version of the copy its worker holds (tfkv.ps.replies)
    ("PULL", False): Schema(_HOLDS, meta_optional=True),
    ("GET_STATE", False): Schema(),
    ("SET_STATE", False): Schema(_STATE, data="optional"),
    ("PING", False): Schema(),
    ("FEEDBACK", False): Schema(_FEEDBACK, data="optional"),
    # keys pushed and pulled in one request: small ones fused (tfkv.ps.kvworker decides, tfkv.ps.worker
    # stages; keys: server-side ids), or without metadata one key, the header's
    ("PUSHPULL", False): Schema(obj({"keys": array(integer(), MAX_FUSED_KEYS), "holds": integer()},
                                    optional_fields=("keys", "holds")), data="required", meta_optional=True),
    # server -> worker
    # under both_ways compression: the copy's version the reply makes, the 2-bit words' threshold
    ("PULL", True): Schema(obj({"version": integer(), "threshold": number}, optional_fields=("version", "threshold")),
                           data="required", meta_optional=True),
    ("PUSHPULL", True): Schema(data="required"),
    ("GET_STATE", True): Schema(_STATE, data="required"),
    ("ACK", True): Schema(),
    ("FEEDBACK", True): Schema(_FEEDBACK, data="required"),
    ("PING", True): Schema(obj({"held": integer()})),  # how many earlier requests the server holds
    # "left": the worker whose leaving the job makes the request impossible (tfkv.errors.reacting)
    ("ERROR", True): Schema(obj({"message": text(MAX_ERROR_TEXT), "left": text(200)}, optional_fields=("left",))),
}


def check(kind: str, reply: bool, meta: dict[str, Any] | None, has_data: bool) -> None:
    """Raise SchemaError unless a message of this type and direction may carry this metadata
    and (has_data) a payload."""
    schema = SCHEMAS.get((kind, reply))
    if schema is None:
        raise SchemaError(f"{kind} is not a {'reply' if reply else 'request'} in this protocol")
    if meta is None:
        if schema.meta is not None and not schema.meta_optional:
            raise SchemaError(f"{kind} needs metadata")
    elif schema.meta is None:
        raise SchemaError(f"{kind} carries no metadata")
    else:
        schema.meta(meta, "")
    if has_data and schema.data == "none":
        raise SchemaError(f"{kind} carries no payload")
    if not has_data and schema.data == "required":
        raise SchemaError(f"{kind} needs a payload")
