"""The admission guard: pure decisions (``rules``), the webhook server (``server``) and the
detection of what guard is installed (``guard``). See docs/install.md, "Admission guard"."""
