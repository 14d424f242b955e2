"""BitDP's CPU cost per step on one rank: channel-encode + pack this rank's linear weights,
then decode-and-reduce the gathered codes of P ranks (what every rank does in the hook),
timed on one thread for the shapes of the end-to-end benchmark's GPT (d_model 128, 4
layers: attention 384x128 and 128x128, MLP 512x128 and 128x512 per layer).

    python -m benchmarks.codecs.bitdp [-P 4] [--d-model 128] [--layers 4]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.codecs.driver import median_seconds

from lowbit_strategy.codecs import channel_encode
from lowbit_strategy.collectives.gathered import PayloadLayout, decode_reduce, matrix_shape, pack_payload


def _median_ms(fn, repeat: int = 15) -> float:
    return 1e3 * median_seconds(fn, repeat, torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-P", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = args.d_model
    mats = [torch.randn(s) for s in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * args.layers]
    print(f"BitDP codec cost per step and rank, P={args.P}, {sum(m.numel() for m in mats):,} quantized values, "
          "1 thread (median of 15)")
    print("| bits | encode + pack ms | decode-reduce of P ranks ms |")
    print("|---:|---:|---:|")
    for bits in (2, 1):
        layout = PayloadLayout.of([matrix_shape(m) for m in mats], bits)

        def encode():
            coded = [channel_encode(m, bits, validate=False) for m in mats]
            return pack_payload([c for c, _ in coded], [s for _, s in coded], layout)

        words, scales = encode()
        every, every_scales, out = words.repeat(args.P, 1), scales.repeat(args.P, 1), torch.empty(layout.numel)
        decode = _median_ms(lambda: decode_reduce(every, every_scales, layout, out=out))
        print(f"| {bits} | {_median_ms(encode):.1f} | {decode:.1f} |")


if __name__ == "__main__":
    main()
