"""python -m benchmarks: see benchmarks/run.py and docs/benchmarks.md."""

from __future__ import annotations

import argparse
import tempfile

from .run import main

parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description="ckpt's save/restore benchmarks against peers and the raw limit")
parser.add_argument("--size-gib", type=float, default=1.0, help="case (a): total size of the 64 tensors")
parser.add_argument("--small-count", type=int, default=10000, help="case (b): number of 1 KiB tensors")
parser.add_argument("--reps", type=int, default=5, help="repetitions per system (median reported)")
parser.add_argument("--tmpfs", default="/dev/shm", help="a tmpfs directory (CPU cost); '' to skip")
parser.add_argument("--disk", default=tempfile.gettempdir(), help="a directory on disk; '' to skip")
parser.add_argument("--cases", default="a,b,c,d,e,async,checksum,import,plan,sharded,hdf5child,one,cli,s3,compress,"
                                       "average,"
                                       "incremental",
                    help="comma-separated: a b c d e async checksum import plan sharded hdf5child one cli stats s3 "
                         "compress average incremental incremental-chunks open (docs/benchmarks.md)")
parser.add_argument("--average-mib", type=int, default=512, help="case average: size of each of the 3 inputs")
parser.add_argument("--open-count", type=int, default=20000, help="case open: number of tensors in the index")
parser.add_argument("--cli-gib", type=float, default=1.0, help="case cli: size of the 8-tensor checkpoint")
parser.add_argument("--inc-model-mib", type=int, default=1024, help="case incremental: the frozen-backbone model")
parser.add_argument("--inc-saves", type=int, default=10, help="case incremental: frozen-backbone saves after the first")
parser.add_argument("--inc-rows", type=int, default=1 << 20, help="case incremental: rows of the 64-wide table")
parser.add_argument("--inc-table-saves", type=int, default=20, help="case incremental: table saves after the first")
parser.add_argument("--inc-chunk-mib", type=int, default=None,
                    help="case incremental: the Savers' chunk_bytes in MiB (default: Saver's default)")
parser.add_argument("--inc-restore-reps", type=int, default=3,
                    help="case incremental: cold restores of each kept checkpoint, each beside a full one")
parser.add_argument("--s3-model-mib", type=int, default=256, help="case s3: model saved and restored")
parser.add_argument("--s3-big-mib", type=int, default=1024, help="case s3: checkpoint of the one-tensor read")
parser.add_argument("--async-interval", type=float, default=10.0,
                    help="case async: seconds of simulated training between two saves")
parser.add_argument("--async-rounds", type=int, default=3,
                    help="case async: rounds of training segments (each configuration once per round)")
parser.add_argument("--async-modes", default="copy only,async,blocking",
                    help="case async: comma-separated save configurations of the training table: copy only, "
                         "async, blocking, 'async nice N' (the writer thread N nice steps lower)")
parser.add_argument("--systems", default="", help="comma-separated name fragments to keep (default: all)")
main(parser.parse_args())
