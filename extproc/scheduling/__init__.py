"""Candidates -> Decision: profiles of filters, weighted scorers and a picker.

Pure code: no I/O, no awaits, no imports of grpc or redis. Everything a plugin needs arrives
in the `Candidate`s, gathered once per request before scheduling starts.
"""

from extproc.scheduling.framework import Filter, Picker, Profile, Scheduler, Scorer

__all__ = ["Filter", "Picker", "Profile", "Scheduler", "Scorer"]
