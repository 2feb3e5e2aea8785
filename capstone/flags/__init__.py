"""The command line's parts below its parser (capstone.cli): argument types and usage sentences
(usage), named settings (presets), what a run does besides training (options), what a named path
is (paths), and the serial tools' exit on a closed pipe (pipe)."""
