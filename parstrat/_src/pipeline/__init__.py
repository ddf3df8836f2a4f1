"""Pipeline parallelism internals: partition, schedules, engine, drawing."""
