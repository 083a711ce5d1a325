"""Ray actors built on chatlearn_mem (see the Ray actors issue)."""
