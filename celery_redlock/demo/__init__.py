"""The README's demo: real masters, a real broker and real workers, checked for overlaps.

``run`` drives it, ``tasks`` is the Celery app the workers run, ``ledger`` records each hold.
"""
