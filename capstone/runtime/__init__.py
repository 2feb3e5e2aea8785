"""The process around a run: stop signals, the run-directory lock, start-up checks, the C heap."""
