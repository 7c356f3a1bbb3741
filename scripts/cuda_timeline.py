#!/usr/bin/env python3
"""Summarises a CUDA device timeline (XINFER_CUDA_TIMELINE=FILE, plugins/cuda/backend.cu).

Each line of FILE is one stream operation queued outside a graph capture: index, name ("op",
"graph", "upload", "download", "download_async", "copy"), op type (-1 if not an op), the device
time from the previous operation's end to its own end (µs), and 1 if the device had already
finished the previous operation when the host queued this one (the device idled, waiting for the
host). The decode steps show as segments from one graph launch to the next; this prints a few of
them, the mean of every component over the later steps shaped like the fourth, and the graphs launched
back to back (xinfer bench's replay timing) for comparison. `*` marks an operation the device
waited for.

    XINFER_CUDA_TIMELINE=/tmp/tl.tsv xinfer bench --model M --load-format dummy --device cuda ...
    python3 scripts/cuda_timeline.py /tmp/tl.tsv
"""
import sys

OPS = {1: 'EMBEDDING', 2: 'RMSNORM', 3: 'ADD_RMSNORM', 4: 'MATMUL', 5: 'ROPE', 6: 'SWIGLU', 7: 'SCALE',
       8: 'ADD', 9: 'KV_STORE', 10: 'ATTENTION', 11: 'MOE_ROUTE', 12: 'MOE_EXPERTS', 13: 'ARGMAX',
       14: 'SAMPLE', 15: 'CONVERT', 16: 'ROPE_KV_STORE', 17: 'ADD_RMSNORM_MATMUL',
       18: 'MOE_ROUTE_EXPERTS'}


def main(path):
    marks = []  # (name, device µs since the previous mark, device idle when queued)
    for line in open(path):
        _, what, op, dt, starved = line.rstrip('\n').split('\t')
        marks.append((OPS.get(int(op), what) if what == 'op' else what, float(dt), starved == '1'))
    launches = [i for i, m in enumerate(marks) if m[0] == 'graph']
    print(f'{len(marks)} operations, {len(launches)} graph launches')
    steps = [marks[a:b] for a, b in zip(launches, launches[1:] + [len(marks)])]
    for k in sorted({2, 3, 4, len(steps) // 2}):
        if k < len(steps):
            s = steps[k]
            parts = '  '.join(f'{w}{"*" if idle else ""} {dt:.1f}' for w, dt, idle in s)
            print(f'step {k}: {sum(m[1] for m in s):9.1f} us  {parts}')
    if len(steps) > 4:
        shape = [m[0] for m in steps[3]]
        same = [s for s in steps[1:] if [m[0] for m in s] == shape]  # the first includes what ran before it
        print(f'{len(same)} steps shaped like step 3: mean device time per operation (us), share queued to an idle device')
        for j, what in enumerate(shape):
            times = [s[j][1] for s in same]
            idle = sum(s[j][2] for s in same) / len(same)
            print(f'  {what:16s} {sum(times) / len(times):9.1f}   idle {idle:.2f}')
        print(f'  {"step":16s} {sum(sum(m[1] for m in s) for s in same) / len(same):9.1f}')
    alone = [s for s in steps if len(s) == 1]
    if alone:
        print(f'{len(alone)} graphs launched back to back: {sum(s[0][1] for s in alone) / len(alone):.1f} us each')


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
