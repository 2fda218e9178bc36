"""Cases shared by the single-process and MPI compression tests."""

import numpy as np

ODD_COUNTS = [0, 1, 2, 3, 5, 7, 63, 64, 65, 255, 257, 4097, 100_003]


def k_largest(x, k):
    """Indices of the k largest magnitudes of x, ascending; lower indices win ties."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def topk_reuse_select(x, k, reuse_steps, state):
    """TopK(ratio, reuse_steps) on one rank, as docs/compression.md ("Threshold
    reuse") states it: (indices sent, ascending; the tensor's state after).
    state: None (a new tensor) or (threshold t, the k it was taken for, calls
    left that may reuse it). With uses left, a positive t and the same k, every
    index with |x| >= t is sent if their count c is in [ceil(k/2), 2k];
    otherwise the exact k are, and their smallest magnitude is the new t with
    reuse_steps uses."""
    if state is not None:
        t, k_then, left = state
        if left > 0 and k_then == k and t > 0:
            sent = np.flatnonzero(np.abs(x) >= t)
            if (k + 1) // 2 <= sent.size <= 2 * k:
                return sent, (t, k, left - 1)
    sent = k_largest(x, k)
    return sent, (np.abs(x[sent]).min() if k else np.float32(0), k, reuse_steps)


def fp16_round(v):
    """FP16 on the wire and back: IEEE half, round to nearest even."""
    return v.astype(np.float16).astype(np.float32)


def bf16_round(v):
    """BF16 on the wire and back: the upper 16 bits, round to nearest even (finite values)."""
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return (kept & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def int8_round(v, block):
    """Int8 with round-to-nearest on the wire and back: per block of `block` values (counted
    from the start of the encoded chunk), scale = absmax / 127, q = rint(v * 127 / absmax)."""
    out = np.empty_like(v)
    for lo in range(0, v.size, block):
        x = v[lo : lo + block]
        amax = np.abs(x).max()
        shift = np.float32(2.0**64) if amax < np.float32(2.0**-100) else np.float32(1)  # the tiny-block staging
        scale = amax / np.float32(127)
        inv = np.float32(127) / (amax * shift) if amax > 0 else np.float32(0)
        q = np.clip(np.rint((x * shift) * inv), -127, 127)
        out[lo : lo + block] = q.astype(np.float32) * scale
    return out


def ring_roundtrip(codec):
    """The encode-decode of one chunk that codec (FP16, BF16, Int8 nearest) makes on the ring."""
    if codec.name == "fp16":
        return fp16_round
    if codec.name == "bf16":
        return bf16_round
    block = codec.get_config()["block"]
    return lambda v: int8_round(v, block)


def ring_chunks(size, count, chunk_bytes):
    """Per segment of the ring (segment s's owner after the reduce-scatter is rank s - 1), its
    chunks as slices: segments as even as possible (the first count % size one longer), each
    cut into the same number of chunks of at most chunk_bytes / 4 values."""
    base, extra = divmod(count, size)
    offsets = [0]
    for s in range(size):
        offsets.append(offsets[-1] + base + (s < extra))
    longest = max(offsets[s + 1] - offsets[s] for s in range(size))
    per_chunk = max(1, chunk_bytes // 4)
    chunks = max(1, -(-longest // per_chunk))
    per_chunk = max(1, -(-longest // chunks))
    return [
        [
            slice(
                offsets[s] + min(offsets[s + 1] - offsets[s], k * per_chunk),
                offsets[s] + min(offsets[s + 1] - offsets[s], (k + 1) * per_chunk),
            )
            for k in range(chunks)
        ]
        for s in range(size)
    ]


def compressed_ring_reference(inputs, residuals, codec, op, chunk_bytes):
    """The compressed ring allreduce as docs/compression.md states it, in float32: segment g's
    partial sum starts at rank g as its values (+ its residual), each next rank decodes it and
    adds its own values (+ residual) and encodes the sum again, the owner (rank g - 1) scales it
    for an average and encodes the final value once, which every rank decodes. A rank with a
    residual (error feedback; None: none) keeps what its encoding of each element dropped, the
    owner's in sum units. Returns (result, the residuals after)."""
    size, count = len(inputs), inputs[0].size
    roundtrip = ring_roundtrip(codec)
    scale = np.float32(1.0 / size) if op == "average" else np.float32(1)
    err_scale = np.float32(1.0 / (1.0 / size)) if op == "average" else np.float32(1)
    residuals = [None if r is None else r.copy() for r in residuals]
    result = np.zeros(count, np.float32)

    def own(r, at):
        return inputs[r][at] if residuals[r] is None else inputs[r][at] + residuals[r][at]

    def keep(r, at, dropped):
        if residuals[r] is not None:
            residuals[r][at] = np.where(np.isfinite(dropped), dropped, np.float32(0))

    for g, chunks in enumerate(ring_chunks(size, count, chunk_bytes)):
        for at in chunks:
            if at.stop == at.start:
                continue
            value = own(g, at)
            sent = roundtrip(value)
            keep(g, at, value - sent)
            for step in range(1, size):
                r = (g + step) % size
                value = own(r, at) + sent
                if step == size - 1:
                    value = value * scale if scale != 1 else value
                    sent = roundtrip(value)
                    keep(r, at, (value - sent) * err_scale if err_scale != 1 else value - sent)
                else:
                    sent = roundtrip(value)
                    keep(r, at, value - sent)
            result[at] = sent
    return result, residuals


def topk_reference(inputs, residuals, states, codec, op):
    """A top-k allreduce as docs/compression.md states it, in float32: each rank sends its k
    largest |values + residual| (with reuse_steps, what topk_reuse_select sends), scaled by
    1/size for an average; the pairs are summed in rank order into zeros; the split algorithm
    (named, or auto's choice for this size and count) keeps the k largest sums among the indices sent (lower indices win ties). A rank's residual
    (None: it keeps none) holds values + residual except where its pair reached the result;
    states: per rank its threshold state (topk_reuse_select's), or None. Returns (result, the
    residuals after, the states after)."""
    size, count = len(inputs), inputs[0].size
    k, reuse = codec.k(count), codec.get_config()["reuse_steps"]
    scale = np.float32(1.0 / size) if op == "average" else np.float32(1)
    summed, sent = np.zeros(count, np.float32), []
    residuals, states = list(residuals), list(states)
    for r in range(size):
        x = inputs[r] if residuals[r] is None else inputs[r] + residuals[r]
        if residuals[r] is not None and reuse:
            idx, states[r] = topk_reuse_select(x, k, reuse, states[r])
        else:
            idx = k_largest(x, k)
        sent.append(idx)
        summed[idx] += x[idx] * scale if scale != 1 else x[idx]
        if residuals[r] is not None:
            residuals[r] = x.copy()
    if codec.algorithm_for(size, count) == "split":
        candidates = np.unique(np.concatenate(sent))
        order = np.lexsort((candidates, -np.abs(summed[candidates])))
        chosen = np.sort(candidates[order[:k]])
        result = np.zeros(count, np.float32)
        result[chosen] = summed[chosen]
    else:
        chosen, result = np.arange(count), summed
    for r in range(size):
        if residuals[r] is not None:
            residuals[r][np.intersect1d(sent[r], chosen)] = 0
    return result, residuals, states
