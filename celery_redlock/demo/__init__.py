"""The README's demo: real masters, a real broker and real workers, checked for
overlaps and for every invoice charged exactly once.

``run`` drives it, ``tasks`` is the Celery app the workers run, ``ledger`` records each call
and hold.
"""
