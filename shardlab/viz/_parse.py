"""Text a learner types into an explorer, as Python values (ValueError with a clear message)."""

from __future__ import annotations

import ast
import re

from torch.distributed.tensor import Partial, Replicate, Shard

__all__ = ["parse_ints", "parse_padding", "parse_placements", "parse_sizes"]


def parse_ints(
    text, name: str, allow_empty: bool = False, minimum: int | None = 0
) -> list[int] | None:
    """``"5,5,4,4"``, ``"5 5 4 4"``, ``"[5, 5, 4, 4]"``, ``"2x2"`` -> ``[5, 5, 4, 4]``; a list of
    ints passes through. Empty text gives None when ``allow_empty``."""
    if not isinstance(text, str):
        values = list(text) if isinstance(text, (list, tuple)) else [text]
    else:
        body = text.strip().strip("[]()").strip()
        if not body:
            if allow_empty:
                return None
            raise ValueError(f"{name} is empty: type whole numbers like 5,5,4,4")
        values = [v for v in re.split(r"[\s,;]+|(?<=\d)[x×](?=\d)", body) if v]
    out = []
    for v in values:
        try:
            if isinstance(v, bool) or (not isinstance(v, (int, str))):
                raise ValueError
            out.append(int(v))
        except ValueError:
            raise ValueError(
                f"{name}: {v!r} is not a whole number (type whole numbers separated by commas)"
            ) from None
    if minimum is not None and any(v < minimum for v in out):
        raise ValueError(f"{name}: every value must be >= {minimum}, got {out}")
    return out


def parse_padding(text):
    """``'same'``, ``'valid'``, ``1`` or ``(1, 2)`` from text such as ``"1"`` or ``"1,2"``."""
    if not isinstance(text, str):
        return tuple(text) if isinstance(text, list) else text
    word = text.strip().strip("'\"").lower()
    if word in ("same", "valid"):
        return word
    values = parse_ints(text, "padding")
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return tuple(values)
    raise ValueError(f"padding: give same, valid, one int or left,right; got {text!r}")


_SHARD = re.compile(r"(?:shard|s)\(\s*(-?\d+)\s*\)", re.I)
_REPLICATE = re.compile(r"(?:replicate|r)(?:\(\s*\))?", re.I)
_PARTIAL = re.compile(r"(?:partial|p)(?:\(\s*(?:reduce_op\s*=\s*)?['\"]?(\w*)['\"]?\s*\))?", re.I)


def parse_placements(text) -> list:
    """``"Shard(0), Replicate()"`` or ``"S(0) R"`` / ``"P(avg)"`` -> torch placements."""
    if not isinstance(text, str):
        return list(text)
    token = r"\w+\s*(?:\([^)]*\))?"
    tokens = re.findall(token, text)
    rest = re.sub(token, "", text).strip(" ,;[]")
    if rest:
        raise ValueError(f"placements: cannot read {rest!r} in {text!r}")
    if not tokens:
        raise ValueError("placements is empty: type e.g. Shard(0) or Shard(0), Replicate()")
    out = []
    for tok in tokens:
        tok = tok.strip()
        if m := _SHARD.fullmatch(tok):
            out.append(Shard(int(m.group(1))))
        elif _REPLICATE.fullmatch(tok):
            out.append(Replicate())
        elif m := _PARTIAL.fullmatch(tok):
            out.append(Partial(m.group(1) or "sum"))
        else:
            raise ValueError(
                f"placements: cannot read {tok!r}; use Shard(d), Replicate() or Partial() "
                "(short: S(0), R, P), separated by commas"
            )
    return out


def parse_sizes(text):
    """Shard sizes as :meth:`ShardLayout.build` takes them: blank -> None (DTensor's even
    split), ``"5,5,4,4"`` (1-D mesh), ``"[4, 3], [2, 2, 1]"`` or ``"None, [3, 3]"`` (one entry
    per mesh dim), ``"[3, 2], [[2, 1], [1, 1]]"`` (a dim sharded twice)."""
    if not isinstance(text, str):
        return text
    if not text.strip():
        return None
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        raise ValueError(
            f"sizes: cannot read {text!r}; type e.g. 5,5,4,4 or [4, 3], [2, 2, 1] (blank: even)"
        ) from None
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, (list, tuple)) or not _ints_or_none(value):
        raise ValueError(f"sizes: {text!r} must be whole numbers, lists of them or None")
    return list(value)


def _ints_or_none(value) -> bool:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return True
    return isinstance(value, (list, tuple)) and all(_ints_or_none(v) for v in value)
