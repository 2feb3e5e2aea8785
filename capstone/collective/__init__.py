"""The communicator and its deadline: every collective of a run goes through `comm.Comm`, issued
non-blocking and waited on under `deadline.Deadline` (a watchdog process guards what MPI or HDF5
offers only blocking); `launch` starts the world, `agree` makes one decision end the same way on
every rank."""
