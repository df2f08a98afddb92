"""What tests/celery/test_celery_enqueue_lost.py runs on real workers: a Celery app of
``lock_enqueue`` tasks (:mod:`.app`) and a publisher process (:mod:`.publisher`)."""
