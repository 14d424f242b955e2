"""Hypothesis profiles: ``dev`` (default) explores new random examples on every run;
``ci`` (``HYPOTHESIS_PROFILE=ci``, set by .ci/run) derandomizes, so a landing is judged on
the same examples each time and a newly found counterexample shows up in development
first; ``thorough`` runs 20x the examples (before changing a codec). None has a
per-example deadline: on a loaded 2-core machine wall time says
nothing about correctness."""
import os

from hypothesis import settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
