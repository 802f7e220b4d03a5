"""Comparing two checkpoints: ``compare``, what ``ckpt diff`` reports.

Keys, dtypes, shapes, values and metadata. Values are compared wherever shapes match (also
across numeric dtypes, float32 against float16), a pair of tensors streaming through in
bounded chunks or pieces, each checked against its checksum (``ckpt.tools.valuediff``). NaNs
in the same place are equal. With ``atol``/``rtol``, an element is close when
``|a - b| <= atol + rtol * |b|`` (numpy's isclose, B as the reference).

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> a, b = os.path.join(d, "a.msgpack"), os.path.join(d, "b.h5")
    >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, 2.0]), "v": ckpt.Variable([0])}).save(a)
    >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, 2.5])}).save(b)
    >>> result = ckpt.compare(a, b)
    >>> result.same, result.only_in_a, result.differ
    (False, ['v'], ['w'])
    >>> result.tensor("w").values
    ValueDiff(count=2, unequal=1, outside=1, max_abs=0.5, max_rel=0.2, rel_l2=0.2236...)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt import dtypes
from ckpt.tools.chunks import reusing_buffers
from ckpt.tools.jsonview import jsonable
from ckpt.tools.sources import Checkpoint, Keys, opened, select_keys
from ckpt.storage.urls import StorageOptions
from ckpt.errors import KeyNotFoundError
from ckpt.tools.valuediff import ValueDiff, _Tally, compare_values, tensor_values

__all__ = ["ValueDiff", "TensorChange", "MetadataChange", "Comparison", "compare", "compare_values", "CHANGES"]

#: What can happen to a key, in the order the counts are reported.
CHANGES = ("only in A", "only in B", "changed dtype or shape", "differ", "within tolerance", "identical",
           "metadata")
#: The changes that make two checkpoints different.
DIFFERENT = ("only in A", "only in B", "changed dtype or shape", "differ", "metadata")


@dataclass(frozen=True)
class TensorChange:
    """What happened to one key from A to B.

    ``change`` is one of CHANGES (not "metadata"); ``a`` and ``b`` are the TensorInfos (dtype,
    shape, nbytes) on each side (None where the key is missing); ``values`` says how the
    values differ, for keys present on both sides with one shape (None otherwise).
    """

    key: str
    change: str
    a: Any
    b: Any
    values: ValueDiff | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "change": self.change}
        for side, info in (("a", self.a), ("b", self.b)):
            if info is not None:
                doc[side] = {"dtype": dtypes.dtype_label(info.dtype), "shape": list(info.shape)}
        if self.a is not None and self.b is not None:
            doc["values"] = None if self.values is None else self.values.to_json()
        return doc


_MISSING: Any = object()


@dataclass(frozen=True)
class MetadataChange:
    """A metadata key whose value differs: ``a`` and ``b`` hold the values (``has_a``/``has_b``
    say whether the key exists on that side)."""

    key: str
    a: Any = None
    b: Any = None
    has_a: bool = True
    has_b: bool = True

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "change": "metadata"}
        doc.update({side: jsonable(value) for side, value, has in (("a", self.a, self.has_a),
                                                                   ("b", self.b, self.has_b)) if has})
        return doc


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: every key of A and B with what happened to it.

    ``tensors`` lists every tensor key of either side, sorted; ``metadata`` the metadata keys
    whose values differ. ``same`` is True when nothing differs beyond the tolerance.
    """

    a: str
    b: str
    tensors: list[TensorChange] = field(default_factory=list)
    metadata: list[MetadataChange] = field(default_factory=list)

    def _keys(self, change: str) -> list[str]:
        return [t.key for t in self.tensors if t.change == change]

    @property
    def only_in_a(self) -> list[str]:
        """Keys only A holds."""
        return self._keys("only in A")

    @property
    def only_in_b(self) -> list[str]:
        """Keys only B holds."""
        return self._keys("only in B")

    @property
    def changed(self) -> list[str]:
        """Keys whose dtype or shape differs."""
        return self._keys("changed dtype or shape")

    @property
    def differ(self) -> list[str]:
        """Keys whose values differ beyond the tolerance."""
        return self._keys("differ")

    @property
    def within_tolerance(self) -> list[str]:
        """Keys whose values differ, all within the tolerance."""
        return self._keys("within tolerance")

    @property
    def identical(self) -> list[str]:
        """Keys with the same dtype, shape and values."""
        return self._keys("identical")

    @property
    def counts(self) -> dict[str, int]:
        """How many keys had each change, in the order of CHANGES."""
        counts = dict.fromkeys(CHANGES, 0)
        for t in self.tensors:
            counts[t.change] += 1
        counts["metadata"] = len(self.metadata)
        return counts

    @property
    def same(self) -> bool:
        """True when no key differs beyond the tolerance (metadata included)."""
        counts = self.counts
        return not any(counts[c] for c in DIFFERENT)

    def tensor(self, key: str) -> TensorChange:
        """The TensorChange of ``key``."""
        for t in self.tensors:
            if t.key == key:
                return t
        raise KeyNotFoundError(f"{key!r} is in neither {self.a} nor {self.b}")

    def to_json(self) -> dict[str, Any]:
        """The JSON view ``ckpt diff --json`` prints: "a", "b", "same", "counts", "changes"."""
        return {"a": self.a, "b": self.b, "same": self.same, "counts": self.counts,
                "changes": [t.to_json() for t in self.tensors] + [m.to_json() for m in self.metadata]}


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True, default=repr)


def metadata_changes(ma: dict[str, Any], mb: dict[str, Any]) -> list[MetadataChange]:
    """The metadata keys whose values (or their types) differ, sorted.

    Example:
        >>> [(c.key, c.has_a, c.has_b) for c in metadata_changes({"step": 1, "lr": 0.1}, {"step": 2, "x": 0})]
        [('lr', True, False), ('step', True, True), ('x', False, True)]
    """
    changes = []
    for key in sorted(set(ma) | set(mb)):
        if key not in mb:
            changes.append(MetadataChange(key, a=ma[key], has_b=False))
        elif key not in ma:
            changes.append(MetadataChange(key, b=mb[key], has_a=False))
        elif _shown(ma[key]) != _shown(mb[key]) or type(ma[key]) is not type(mb[key]):
            changes.append(MetadataChange(key, ma[key], mb[key]))
    return changes



def compare(a: Checkpoint, b: Checkpoint, *, atol: float = 0.0, rtol: float = 0.0, keys: Keys = None,
            progress: Callable[[int], None] | None = None,
            storage_options: StorageOptions | None = None, chunk_bytes: int | None = None) -> Comparison:
    """Compare two checkpoints: keys, dtypes, shapes, values and metadata.

    Args:
        a, b: checkpoint files, directories (their latest checkpoints), URLs or open
            ``CheckpointReader``s.
        atol, rtol: tolerances: values within them count as "within tolerance", not "differ".
        keys: None for every key, a regular expression (``re.search``), or a list of keys
            (each must be in A or B); metadata is compared only when ``keys`` is None.
        progress: called with the number of bytes of A compared, as the work goes on.
        storage_options: for URLs, options for the store's fsspec filesystem.
        chunk_bytes: about this many bytes of a tensor are read at a time (None: 8 MiB).

    Returns:
        A Comparison: ``same``, the keys by change, each tensor's ValueDiff.

    Raises:
        CorruptCheckpointError: a tensor fails its checksum.
        KeyNotFoundError: ``keys`` names a key in neither checkpoint, or matches none.
        ValueError: a negative tolerance.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances cannot be negative (atol={atol}, rtol={rtol})")
    with opened(a, storage_options) as ra, opened(b, storage_options) as rb, reusing_buffers():
        ta, tb = ra.tensors, rb.tensors
        union = sorted(set(ta) | set(tb))
        chosen = select_keys(union, keys, f"{ra.path} and {rb.path}")
        changes = []
        tally = _Tally()  # each tensor's is tally.next(): they share scratch buffers
        for key in chosen:
            ia, ib = ta.get(key), tb.get(key)
            if ib is None:
                changes.append(TensorChange(key, "only in A", ia, None))
                continue
            if ia is None:
                changes.append(TensorChange(key, "only in B", None, ib))
                continue
            values = None
            # values are compared wherever shapes match, also across numeric dtypes (float32 -> float16)
            if ia.shape == ib.shape and dtypes.is_string(ia.dtype) == dtypes.is_string(ib.dtype):
                tally = tally.next()
                values = tensor_values(ra, rb, key, atol, rtol, tally, chunk_bytes)
                if progress is not None:
                    progress(ia.nbytes)
            if ia.dtype != ib.dtype or ia.shape != ib.shape:
                change = "changed dtype or shape"
            elif values is None:  # unreachable: equal shapes and kinds were compared above
                raise AssertionError(key)
            else:
                change = "differ" if values.outside else "within tolerance" if values.unequal else "identical"
            changes.append(TensorChange(key, change, ia, ib, values))
        metadata = metadata_changes(ra.metadata, rb.metadata) if keys is None else []
        return Comparison(ra.path, rb.path, changes, metadata)

