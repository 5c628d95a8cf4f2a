"""Installs the gs:// stand-in (tests/fake_gcs.py) in a subprocess whose environment names one
(fake_gcs.subprocess_env puts this directory on PYTHONPATH)."""
import os

if os.environ.get("UMOE_FAKE_GCS_ROOT"):
  import fake_gcs

  fake_gcs.install_from_env()
