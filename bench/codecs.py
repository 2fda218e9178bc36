"""Codec throughput on one core: encode and decode GB/s of float32 input.

    python bench/codecs.py                          # 64 MiB, all codecs
    python bench/codecs.py --mib 16 --repeats 9 --codecs 'int8,topk(ratio=0.01)'

GB/s = original float32 bytes (10^9 per second) / median time over repeats,
time = CPU time of the calling thread (time.thread_time), so other jobs on a
shared machine slow the figures only through the memory system, not through
preemption. encode includes top-k's selection; decode of top-k zeroes the
output and scatters the pairs. Single process: the kernels the ring runs,
through the codecs' whole-array hooks (Codec.encode_into, decode_into), on the
calling thread.
"""

import argparse
import statistics
import sys
import time

import numpy as np

from hpcdl.compression import from_text_list
from hpcdl.measure import rate, show


def time_median(fn, repeats):
    fn()  # warm up (page faults of fresh buffers)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="input size in MiB of float32 (default 64)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--codecs",
        default="fp16,bf16,int8,int8(block=64),topk(ratio=0.01),topk(ratio=0.001)",
        help="hpcdl.compression.from_text's syntax, comma-separated",
    )
    args = p.parse_args(argv)
    n = args.mib * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    print(f"{'codec':<28} {'wire/orig':>9} {'encode GB/s':>12} {'decode GB/s':>12} {'enc+dec GB/s':>13}")
    for codec in from_text_list(args.codecs):
        enc = np.empty(codec.encoded_size(n), dtype=np.uint8)
        t_enc = time_median(lambda: codec.encode_into(x, enc), args.repeats)
        t_dec = time_median(lambda: codec.decode_into(enc, out), args.repeats)
        gb = x.nbytes / 1e9
        print(
            f"{str(codec):<28} {enc.size / x.nbytes:9.4f} {show(rate(gb, t_enc), '12.2f')} "
            f"{show(rate(gb, t_dec), '12.2f')} {show(rate(gb, t_enc + t_dec), '13.2f')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
