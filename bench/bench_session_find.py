"""Cost of finding the session a request continues (LiveSessions.find): the old full scan of
the request's block keys against probing near the index's match lengths. A new 2,048-block
session on a shared 190-block prompt, 1,000 live sessions.

    .venv/bin/python bench/bench_session_find.py
"""

import random
import timeit

from extproc.scheduling.plugins.sessions import LiveSessions

s = LiveSessions(1e9, 50000)
rng = random.Random(1)
shared = [rng.getrandbits(63) for _ in range(190)]
for _ in range(1000):  # 1,000 live sessions
    s.touch(None, "a", shared + [rng.getrandbits(63) for _ in range(200)])
new = shared + [rng.getrandbits(63) for _ in range(1858)]  # a new 2,048-block session


def old_find(keys):
    by = s._by_key
    for key in reversed(keys):
        c = by.get(key)
        if c is not None:
            return c
    return None


def disjoint_exit(keys):  # main before this change: a C-speed exit, then the full scan
    if s._by_key.keys().isdisjoint(keys):
        return None
    return old_find(keys)


n = 2000
t_old = timeit.timeit(lambda: old_find(new), number=n) / n * 1e6
t_dis = timeit.timeit(lambda: disjoint_exit(new), number=n) / n * 1e6
t_new = timeit.timeit(lambda: s.find(new, [190.0, 190.0, 0.0]), number=n) / n * 1e6
print(
    f"new session, 2,048 blocks, 1,000 live sessions: "
    f"full scan {t_old:.1f} us, isdisjoint exit {t_dis:.1f} us, probe {t_new:.1f} us"
)
