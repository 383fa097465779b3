"""The resources role: hosts one environment plug-in and its per-episode sessions."""
