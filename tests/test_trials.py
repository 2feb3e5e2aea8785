"""Issue 28's trials (the "Found" list, 1-10) and issue 34's (11-16) as a new user types them: scripts/trials replays every
command, each must end with exit 0 and the right result or one clear paragraph, never a traceback.
The details of each trial are tested here:

 1 healthy runs end "failed"    tests/test_learning.py (the table of (a) cases, the licence texts, overfitting)
 2 --vocab-size above the data  tests/test_sample.py::test_a_model_vocabulary_larger_than_the_data_still_samples
 3 --log-every, lr, held_out    tests/test_endings.py::test_log_every_prints_every_evaluation_with_the_lr
 4 guard abort, timeout,        tests/test_endings.py (summary.json "diverged", "timeout"; no appending),
   tensorboard, appending       tests/test_observe.py::test_tensorboard_without_the_package_says_how_to_install
 5 prepare overwrites           tests/test_prepare.py (another dataset, a non-dataset directory, same inputs again)
 6 sampler nan, seed -1         tests/test_sample.py::test_bad_arguments_are_one_clear_paragraph
 7 settings silently changed    tests/test_endings.py (--preset, warmup, global batch, --resume auto, Slurm step)
 8 tracebacks                   tests/test_plot.py (--out a file, a closed pipe), tests/test_cli_fixes.py (--help)
 9 TP plot and banner           tests/test_plot.py::test_timing_parts_are_the_phases_and_skip_totals, and here
10 docs and verify --json       tests/test_cli_fixes.py::test_verify_json_prints_one_json_object, and here
11 one run per directory        tests/test_rundir.py (a foreign checkpoint into an occupied --out; --resume RUN_DIR)
12 fine-tuning, preset warmup   tests/test_finetune.py (the source's settings), tests/test_rundir.py (a preset's warmup)
13 (a) judges what it can       tests/test_learning.py (the table: preempted, too few evaluations, trained weights)
14 export                       tests/test_export.py (overwrite, the umask, a pickle's name, --format hf)
15 advice and exit codes        tests/test_usage.py (every bad flag at once, other trainers' names, exit 2)
16 no venv                      tests/test_usage.py::test_a_python_without_the_venv_gets_one_line_saying_how_to_set_up
"""

import os
import subprocess
import sys

from conftest import ROOT, mpi_env


def test_every_trial_of_issues_28_and_34_ends_well():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "trials")], capture_output=True, text=True,
                         env=mpi_env(), cwd=ROOT, timeout=900)
    print(res.stdout)
    assert res.returncode == 0 and " 0 failed" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count(" ok ") >= 42 and "FAIL" not in res.stdout
