"""freeze_startup_heap: what is alive at start-up leaves the collector's reach; what is
allocated later is still collected (a fresh process, so pytest's own heap is not frozen)."""

import subprocess
import sys
import textwrap


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    code = textwrap.dedent("""
        import gc, weakref
        from worker_protocol import freeze_startup_heap

        class Node:
            pass

        kept = [Node() for _ in range(50_000)]
        tracked = len(gc.get_objects())
        frozen = freeze_startup_heap()
        assert frozen >= 50_000 and frozen >= tracked - 100, (frozen, tracked)
        assert len(gc.get_objects()) < 100  # nothing left for a full collection to walk
        # A cycle made after start-up is garbage as before.
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None
        gc.collect()
        assert ref() is None
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
