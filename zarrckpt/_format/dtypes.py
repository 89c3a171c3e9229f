"""Zarr data types for the ``ml_dtypes`` number formats used by JAX.

zarr-python has no built-in ``bfloat16``, ``float8_*`` or ``int4`` data types,
so without this module a JAX pytree holding such leaves cannot be stored
without first widening (or bit-casting) every leaf. zarr >= 3.1 lets third
parties add data types through :data:`zarr.dtype.data_type_registry`; this
module defines those wrappers and :func:`register` installs them.

The on-disk names follow TensorStore (and the zarr-extensions data type
registry), so arrays written here can be read by TensorStore / Orbax and the
other way round:

* zarr v3 ``data_type`` is the bare name, e.g. ``"bfloat16"``.
* zarr v2 ``dtype`` is the same bare name. It carries no byte-order marker, so
  multi-byte values are always little-endian there (TensorStore's convention).
* Float fill values are JSON numbers or ``"NaN"`` / ``"Infinity"`` /
  ``"-Infinity"``, as for zarr's own floats. In v3, ``"0x..."`` hex strings
  holding the raw bits are also read, and are written for NaNs whose bits are
  not the type's canonical NaN so that fill values survive bit-exactly.

``int4`` / ``uint4`` are stored one value per byte (the low nibble), which is
both how NumPy holds ``ml_dtypes`` 4-bit integers in memory and what the
zarr-extensions ``int4`` spec and TensorStore's ``bytes`` codec use. TensorStore
has no ``uint4``, so that one only round-trips through zarr-python.

Known limitation (zarr, not this module): when ``write_empty_chunks`` is off
(zarr's default), zarr skips chunks whose values all equal the fill value. For
NumPy dtypes of kind ``"f"`` it compares bit patterns when the fill value is
zero, but ``bfloat16`` and ``float8_e4m3fn`` have kind ``"V"`` in NumPy, so a
chunk made only of ``0.0``/``-0.0`` is treated as empty and reads back as
``+0.0``. Create arrays with ``config={"write_empty_chunks": True}`` where
``-0.0`` must survive in such chunks.

Writing zarr v2 arrays of these types needs ``compressors=None``. zarr's v2
path hands the typed chunk straight to the numcodecs compressor, and that
fails with "cannot include dtype ... in a buffer". Reading compressed v2
arrays, such as TensorStore's, works. The v3 path is not affected.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    Self,
    SupportsFloat,
    SupportsIndex,
    SupportsInt,
    TypeGuard,
    cast,
    overload,
)

import ml_dtypes
import numpy as np
import zarr.errors
from zarr.core.dtype import common as _zarr_dtype_common
from zarr.core.dtype.common import HasEndianness, HasItemSize, check_dtype_spec_v2
from zarr.core.dtype.npy.common import (
    endianness_to_numpy_str,
    get_endianness_from_numpy_dtype,
)
from zarr.dtype import ZDType, data_type_registry

# Newer zarr moved the exception to zarr.errors; zarr 3.1's path then warns, through a
# module __getattr__ typed as returning object.
DataTypeValidationError = cast("type[ValueError]", getattr(zarr.errors, "DataTypeValidationError", None)
                               or _zarr_dtype_common.DataTypeValidationError)

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat
    from zarr.core.dtype.common import DTypeConfig_V2

__all__ = [
    "BFloat16",
    "Float8E4M3B11FNUZ",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Int4",
    "UInt4",
    "ZDTYPES",
    "register",
]

_SPECIAL_FLOATS: dict[str, float] = {
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
}


_ML_INT_SCALARS: tuple[type[np.generic], ...] = tuple(
    getattr(ml_dtypes, name)
    for name in ("int2", "uint2", "int4", "uint4")
    if hasattr(ml_dtypes, name)
)


def _bits(value: np.generic) -> int:
    """Raw bit pattern of a 1- or 2-byte scalar, as an unsigned integer."""
    arr = np.asarray(value)
    return int(arr.view(f"u{arr.dtype.itemsize}"))


@dataclass(frozen=True, kw_only=True)
class _MLDType(ZDType[np.dtype[Any], Any], HasItemSize):
    """Shared plumbing: one ``ml_dtypes`` scalar type <-> one zarr name.

    Subclasses only set ``scalar_type`` and ``_zarr_v3_name``; the NumPy dtype
    class is derived so the two cannot disagree.
    """

    scalar_type: ClassVar[type[np.generic]]
    _zarr_v3_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "scalar_type" in cls.__dict__:
            # Each ml_dtypes type has its own dtype class; zarr's
            # _check_native_dtype matches on it exactly.
            cls.dtype_cls = type(np.dtype(cls.scalar_type))

    @classmethod
    def from_native_dtype(cls, dtype: np.dtype[Any]) -> Self:
        """Wrap a NumPy dtype of this type (any byte order)."""
        if not cls._check_native_dtype(dtype):
            raise DataTypeValidationError(
                f"Invalid data type: {dtype!r}. Expected an instance of {cls.dtype_cls}."
            )
        if issubclass(cls, HasEndianness):
            return cls(endianness=get_endianness_from_numpy_dtype(dtype))
        return cls()

    def to_native_dtype(self) -> np.dtype[Any]:
        """The NumPy dtype (in this wrapper's byte order, if it has one)."""
        dtype = np.dtype(self.scalar_type)
        if isinstance(self, HasEndianness):
            dtype = dtype.newbyteorder(endianness_to_numpy_str(self.endianness))
        return dtype

    @property
    def item_size(self) -> int:
        """Bytes per element (ml_dtypes 4-bit types occupy a whole byte)."""
        return np.dtype(self.scalar_type).itemsize

    @classmethod
    def _from_json_v2(cls, data: object) -> Self:
        if (
            check_dtype_spec_v2(data)
            and data["name"] == cls._zarr_v3_name
            and data["object_codec_id"] is None
        ):
            # The v2 name has no byte-order marker; TensorStore writes little-endian.
            return cls()
        raise DataTypeValidationError(
            f"Invalid zarr v2 JSON for {cls.__name__}: {data!r}; "
            f"expected dtype {cls._zarr_v3_name!r}."
        )

    @classmethod
    def _from_json_v3(cls, data: object) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(
            f"Invalid zarr v3 JSON for {cls.__name__}: {data!r}; "
            f"expected {cls._zarr_v3_name!r}."
        )

    @overload
    def to_json(self, zarr_format: Literal[2]) -> DTypeConfig_V2[str, None]: ...

    @overload
    def to_json(self, zarr_format: Literal[3]) -> str: ...

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:
        """``"name"`` for v3, ``{"name": name, "object_codec_id": None}`` for v2."""
        if zarr_format == 2:
            if isinstance(self, HasEndianness) and self.endianness != "little":
                # A bare v2 name means little-endian to every other reader.
                raise ValueError(
                    f"{self._zarr_v3_name} can only be stored little-endian in zarr v2."
                )
            return {"name": self._zarr_v3_name, "object_codec_id": None}
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format}")

    def default_scalar(self) -> Any:
        """Zero, matching zarr's numeric types and TensorStore's default fill."""
        return self.scalar_type(0)


@dataclass(frozen=True, kw_only=True)
class _MLFloat(_MLDType):
    """Base for the ml_dtypes floating-point formats."""

    @property
    def _has_inf(self) -> bool:
        return bool(np.isinf(self.scalar_type(math.inf)))

    def _from_hex(self, data: str) -> Any | None:
        """Decode a v3 ``"0x..."`` raw-bits fill value, or None if ``data`` is not one."""
        digits = 2 * self.item_size
        if not (data.startswith("0x") and len(data) == 2 + digits):
            return None
        try:
            raw = int(data[2:], 16)
        except ValueError:
            return None
        return np.array(raw, dtype=f"u{self.item_size}").view(self.scalar_type)[()]

    def _check_scalar(self, data: object) -> TypeGuard[str | SupportsFloat | SupportsIndex]:
        if isinstance(data, str):
            try:
                float(data)
            except ValueError:
                return False
            return True
        return isinstance(data, SupportsFloat | SupportsIndex)

    def cast_scalar(self, data: object) -> Any:
        """Convert a number (or float-like string) to this type, rounding like ml_dtypes."""
        if isinstance(data, self.scalar_type):
            # Returned untouched so NaN payloads are not canonicalised.
            return data
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert {data!r} of type {type(data)} to a scalar of {self}."
            )
        if isinstance(data, str):
            data = float(data)
        elif not isinstance(data, np.generic):
            # ml_dtypes constructors only take numbers and NumPy scalars; float()
            # also handles Decimal, Fraction and other __float__/__index__ objects.
            data = float(data)
        return self.scalar_type(data)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> Any:
        """Decode a fill value: number, "NaN"/"Infinity"/"-Infinity", or (v3) hex bits."""
        if data is None and zarr_format == 2:
            # v2 "no fill value" (TensorStore writes it); zarr normally
            # intercepts it, but a concrete scalar is the safe answer here.
            return self.default_scalar()
        if isinstance(data, str):
            if data in _SPECIAL_FLOATS:
                value = _SPECIAL_FLOATS[data]
                if math.isinf(value) and not self._has_inf:
                    raise ValueError(f"{self._zarr_v3_name} has no infinity; got {data!r}.")
                return self.scalar_type(value)
            if zarr_format == 3:
                from_hex = self._from_hex(data)
                if from_hex is not None:
                    return from_hex
            try:
                # zarr's own floats also accept plain decimal strings such as "1.5".
                return self.scalar_type(float(data))
            except ValueError:
                pass
        elif isinstance(data, int | float) and not isinstance(data, bool):
            return self.scalar_type(float(data))
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}.")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        """Encode a fill value like zarr's Float16/Float32 do."""
        value = self.cast_scalar(data)
        as_float = float(value)
        if math.isnan(as_float):
            bits = _bits(value)
            if zarr_format == 3 and bits != _bits(self.scalar_type(math.nan)):
                # "NaN" means the canonical pattern; keep any other one exact.
                return f"0x{bits:0{2 * self.item_size}x}"
            return "NaN"
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        # Every value of these formats is exact in a double, so this is lossless.
        return as_float


@dataclass(frozen=True, kw_only=True)
class _MLInt(_MLDType):
    """Base for the ml_dtypes 4-bit integers."""

    def _bounds(self) -> tuple[int, int]:
        info = ml_dtypes.iinfo(self.scalar_type)
        return int(info.min), int(info.max)

    def _check_scalar(self, data: object) -> TypeGuard[SupportsIndex | SupportsInt]:
        if isinstance(data, bool | np.bool_):
            return False
        # ml_dtypes' small-int scalars support int() but not __index__.
        return isinstance(data, (SupportsIndex, *_ML_INT_SCALARS))

    def cast_scalar(self, data: object) -> Any:
        """Convert an integer in range to this type; out-of-range raises (no wrap-around)."""
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert {data!r} of type {type(data)} to a scalar of {self}."
            )
        value = int(data)
        low, high = self._bounds()
        if not low <= value <= high:
            raise ValueError(f"{value} is out of range [{low}, {high}] for {self._zarr_v3_name}.")
        return self.scalar_type(value)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> Any:
        """Decode an integer fill value (integral floats such as 0.0 are accepted)."""
        if data is None and zarr_format == 2:
            return self.default_scalar()
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, int) and not isinstance(data, bool):
            return self.cast_scalar(data)
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}.")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> int:
        """Encode a fill value as a JSON integer."""
        return int(self.cast_scalar(data))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """``bfloat16`` (the only multi-byte type here, hence the endianness field)."""

    scalar_type = ml_dtypes.bfloat16
    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"


# The 1-byte types deliberately lack HasEndianness: zarr's bytes codec then
# omits "endian", which is what TensorStore writes and expects for them.
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: no infinities, NaN is S.1111.111."""

    scalar_type = ml_dtypes.float8_e4m3fn
    _zarr_v3_name: ClassVar[Literal["float8_e4m3fn"]] = "float8_e4m3fn"


class Float8E5M2(_MLFloat):
    """``float8_e5m2``: IEEE-like, with infinities and NaNs."""

    scalar_type = ml_dtypes.float8_e5m2
    _zarr_v3_name: ClassVar[Literal["float8_e5m2"]] = "float8_e5m2"


class Float8E4M3FNUZ(_MLFloat):
    """``float8_e4m3fnuz``: no infinities or -0; NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e4m3fnuz
    _zarr_v3_name: ClassVar[Literal["float8_e4m3fnuz"]] = "float8_e4m3fnuz"


class Float8E5M2FNUZ(_MLFloat):
    """``float8_e5m2fnuz``: no infinities or -0; NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e5m2fnuz
    _zarr_v3_name: ClassVar[Literal["float8_e5m2fnuz"]] = "float8_e5m2fnuz"


class Float8E4M3B11FNUZ(_MLFloat):
    """``float8_e4m3b11fnuz``: exponent bias 11, no infinities or -0; NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e4m3b11fnuz
    _zarr_v3_name: ClassVar[Literal["float8_e4m3b11fnuz"]] = "float8_e4m3b11fnuz"


class Int4(_MLInt):
    """``int4``: one value per byte, in the low nibble."""

    scalar_type = ml_dtypes.int4
    _zarr_v3_name: ClassVar[Literal["int4"]] = "int4"


class UInt4(_MLInt):
    """``uint4``: one value per byte, in the low nibble. TensorStore lacks this type."""

    scalar_type = ml_dtypes.uint4
    _zarr_v3_name: ClassVar[Literal["uint4"]] = "uint4"


ZDTYPES: tuple[type[_MLDType], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E4M3B11FNUZ,
    Int4,
    UInt4,
)
"""Every wrapper :func:`register` installs."""

_register_lock = threading.Lock()


def register() -> None:
    """Add the ml_dtypes wrappers to zarr's data type registry.

    Idempotent and thread-safe. It checks the registry on every call rather
    than remembering a flag, so it also restores entries someone unregistered.
    """
    with _register_lock:
        for cls in ZDTYPES:
            if data_type_registry.contents.get(cls._zarr_v3_name) is not cls:
                data_type_registry.register(cls._zarr_v3_name, cls)


# --- What zarrckpt itself asks of dtypes -----------------------------------

_ML_FLOATS = frozenset(np.dtype(z.scalar_type) for z in ZDTYPES if issubclass(z, _MLFloat))
_ML_INTS = frozenset(np.dtype(z.scalar_type) for z in ZDTYPES if issubclass(z, _MLInt))


def number_kind(dtype: np.dtype) -> str:
    """NumPy's kind letter, but "f" for ml_dtypes floats and "i"/"u" for 4-bit ints (NumPy says "V")."""
    dtype = np.dtype(dtype)
    if dtype in _ML_FLOATS:
        return "f"
    if dtype in _ML_INTS:
        return "u" if dtype.name.startswith("u") else "i"
    return dtype.kind


def check_savable(dtype: np.dtype) -> np.dtype:
    """`dtype` if zarrckpt can store it bit-exactly, else TypeError saying why not."""
    dtype = np.dtype(dtype)
    if _savable(dtype):
        return dtype
    raise TypeError(f"dtype {dtype} cannot be saved (bool, integer, float, complex and ml_dtypes types can)")


# Cached per dtype, as is `dtype_name`: a save asks once per leaf, and a dtype's name
# takes NumPy microseconds to spell.
@functools.lru_cache(maxsize=256)
def _savable(dtype: np.dtype) -> bool:
    return number_kind(dtype) in "biufc"


def dtype_name(dtype: np.dtype) -> str:
    """The name recorded in the tree record; `from_name` reverses it."""
    return _name(np.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _name(dtype: np.dtype) -> str:
    return dtype.name


def from_name(name: str) -> np.dtype:
    dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    return check_savable(dtype)


def zero(dtype: np.dtype) -> Any:
    """The fill value of every array: zero of `dtype` (never read: every chunk is written)."""
    return np.zeros((), dtype=dtype)[()]


def nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    """The bytes an array of `shape` and `dtype` holds."""
    return math.prod(shape) * np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=256)  # asked of every leaf of every save
def is_prng_key(dtype: Any) -> bool:
    import jax

    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
