"""Fault injection for the Redlock core: many clients, real masters, nemeses, and a checker.

Layout (one job per module):

- ``register``: the shared register and history, kept on a separate server that no fault touches;
- ``client``: one workload client (a thread, or a process via ``python -m <pkg>.client``);
- ``celery_app`` and ``celery_workload``: the Celery variant, ``RedlockTask`` runs in real
  prefork workers fed by a producer;
- ``checker``: mutual exclusion, lost updates, quorum and the fences' order, from the recorded
  history alone;
- ``cluster``: five real masters (persistent or not, some under libfaketime), proxies per client
  group, the register server;
- ``nemesis``: the faults, scheduled from the seed;
- ``scenarios``: what each scenario runs and what it must show;
- ``run``: the standalone runner that prints the figures table.

The short CI run is ``test_faults.py``; the long run is documented in ``run.py``.
"""
