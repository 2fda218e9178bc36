"""Gradient compression codecs for ``hpcdl.allreduce(..., compression=...)``.

Each codec is a small settings object; its canonical text (``str(codec)``,
e.g. ``"int8(block=256)"``) is what travels to the C++ core, what every rank
must agree on (a difference raises MismatchError naming the ranks) and the key
of ``hpcdl.stats()``. Wire formats, error bounds and when to use which:
docs/compression.md.

Error feedback: an allreduce with a ``name`` keeps, per tensor name (and
communicator), a residual of what compression dropped and adds it back before
the next compression of that tensor; ``reset_state()`` forgets all residuals.
Without a name no state is kept.
"""

import math

from hpcdl import _core

__all__ = ["Codec", "NoCompression", "FP16", "BF16", "Int8", "TopK", "from_config", "residual", "reset_state"]


class Codec:
    """Base class: settings as a dict (get_config/from_config) and a canonical text."""

    name = "?"

    def get_config(self):
        """The codec's settings, enough to rebuild it with from_config()."""
        return {"name": self.name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        name = config.pop("name", cls.name)
        if name != cls.name:
            raise ValueError(f"config is for codec {name!r}, not {cls.name!r}")
        return cls(**config)

    def canonical(self):
        """The text the core and the other ranks see."""
        return self.name

    def encoded_size(self, count):
        """Bytes that ``count`` float32 values take in one encoded chunk."""
        return _core.codec_encoded_size(self.canonical(), int(count))

    def __str__(self):
        return self.canonical() or "none"

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(self.canonical())


class NoCompression(Codec):
    """Dense float32 on the wire (the same as compression=None)."""

    name = "none"

    def canonical(self):
        return ""


class FP16(Codec):
    """Cast to IEEE half (round to nearest even) on the wire, summed in float32."""

    name = "fp16"


class BF16(Codec):
    """Cast to bfloat16 (round to nearest even) on the wire, summed in float32."""

    name = "bf16"


class Int8(Codec):
    """Blockwise 8-bit: per ``block`` values one float32 scale (absmax/127), then int8.

    rounding: "nearest" (default) or "stochastic" (unbiased; draws come from a
    counter-based RNG keyed by ``seed``, the operation's sequence number, the
    rank and the element index, so a run is reproducible).
    """

    name = "int8"

    def __init__(self, block=256, rounding="nearest", seed=0):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 24:
            raise ValueError(f"Int8 block must be an integer in [1, 2**24], got {block!r}")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"Int8 rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
            raise ValueError(f"Int8 seed must be an integer in [0, 2**63), got {seed!r}")
        self.block, self.rounding, self.seed = block, rounding, seed

    def get_config(self):
        return {"name": self.name, "block": self.block, "rounding": self.rounding, "seed": self.seed}

    def canonical(self):
        if self.rounding == "nearest":
            return f"int8(block={self.block})"
        return f"int8(block={self.block},rounding=stochastic,seed={self.seed})"


class TopK(Codec):
    """Keep the k = max(1, ceil(ratio * n)) largest magnitudes; (uint32 index, float32 value) pairs.

    algorithm: how the pairs are reduced (docs/compression.md):
    "allgather": every rank sums all ranks' pairs in rank order (bytes per rank
    grow as (p - 1) 8k); "split": a reduce-scatter over p index ranges, an
    exact global top-k of the sums, an allgather of those k pairs (about
    2 (p - 1)/p 8k per rank, flat in p); "auto" (default): the one that
    receives fewer bytes for this p and tensor size. Use it with a name, so
    error feedback keeps what was dropped.
    """

    name = "topk"
    ALGORITHMS = ("auto", "allgather", "split")

    def __init__(self, ratio=0.01, algorithm="auto"):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1 \
                or not math.isfinite(ratio):
            raise ValueError(f"TopK ratio must be in (0, 1], got {ratio!r}")
        if algorithm not in self.ALGORITHMS:
            raise ValueError(f"TopK algorithm must be one of {self.ALGORITHMS}, got {algorithm!r}")
        self.ratio, self.algorithm = float(ratio), algorithm

    def get_config(self):
        return {"name": self.name, "ratio": self.ratio, "algorithm": self.algorithm}

    def canonical(self):
        if self.algorithm == "auto":
            return f"topk(ratio={self.ratio!r})"
        return f"topk(ratio={self.ratio!r},algorithm={self.algorithm})"

    def k(self, count):
        """How many values a tensor of ``count`` elements keeps."""
        return 0 if count == 0 else min(count, max(1, math.ceil(self.ratio * count)))


_CODECS = {c.name: c for c in (NoCompression, FP16, BF16, Int8, TopK)}


def from_config(config):
    """Rebuild a codec from its get_config() dict."""
    try:
        cls = _CODECS[config["name"]]
    except (KeyError, TypeError):
        raise ValueError(f"not a codec config: {config!r} (name one of {sorted(_CODECS)})") from None
    return cls.from_config(config)


def canonical(compression):
    """The core's text for a ``compression=`` argument (None: dense)."""
    if compression is None:
        return ""
    if not isinstance(compression, Codec):
        raise TypeError(f"compression must be an hpcdl.compression codec or None, got {type(compression).__name__}")
    return compression.canonical()


def residual(name, comm=None):
    """A copy (float32) of the error-feedback residual kept for tensor ``name``, or None."""
    from mpi4py import MPI
    return _core.residual(MPI.COMM_WORLD if comm is None else comm, name)


def reset_state():
    """Forget every error-feedback residual (e.g. between training runs)."""
    _core.reset_compression_state()
