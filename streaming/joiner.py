"""The Flink joiner: the gateway's impression and click logs -> labelled rows in the trainer's
TSV format, exactly once, into the continuous loop's input folder.

``make joiner`` (or ``PYTHONPATH=. .venv-flink/bin/python -m streaming.joiner --help``) runs it
on a local MiniCluster; ``flink run -py streaming/joiner.py`` submits the same job to a cluster
(docs/online.md, "The joiner"). The pipeline:

- two ``filesystem`` JSON tables over ``<logdir>/impressions`` and ``<logdir>/clicks``, scanned
  for new files every ``monitor_interval`` (hidden open files are never read), event time
  ``event_time_ms`` with a watermark ``out_of_orderness`` behind, a log quiet for
  ``idle_timeout`` no longer holding it back; their union keyed by (request id, example) into
  :class:`streaming.join.Join` (the rules and the counters: its docstring);
- Flink's file sink commits the joined lines into ``<state>/staging`` on each checkpoint
  (exactly once), and :class:`streaming.mover.Mover`, in this process, moves them into ``out``
  as files of ``min_rows`` or more, with a manifest line each;
- checkpoints every ``checkpoint_interval`` in ``<state>/checkpoints``, kept on cancel; a
  restart resumes from the newest one there (a ``kill -9`` loses nothing and doubles nothing);
- the counters go to Prometheus on ``metrics_port`` (Flink's reporter): ``joiner_rows_joined``,
  ``joiner_positives``, ``joiner_late_clicks``...
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from recsys_stack.config import config_parser, from_args
from recsys_stack.online import CLICKS, IMPRESSIONS
from streaming.config import JoinerConfig
from streaming.mover import PART_PREFIX, Mover

logger = logging.getLogger("streaming.joiner")
ROOT = Path(__file__).resolve().parents[1]
JOB_NAME = "recsys-joiner"


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (a ``chk-N`` holding ``_metadata``) under ``folder``'s
    job folders: the one a restart resumes from."""
    done = [m.parent for m in folder.glob("*/chk-*/_metadata")]
    return max(done, key=lambda c: (c.stat().st_mtime_ns, int(c.name[4:])), default=None)


def drop_old_checkpoints(folder: Path, keep: Path | None) -> None:
    """Remove the job folders of earlier runs but the one ``keep`` is in (Flink claims that
    one and deletes it once its own first checkpoint subsumes it)."""
    if not folder.is_dir():
        return
    for job in folder.iterdir():
        if job.is_dir() and (keep is None or job != keep.parent):
            shutil.rmtree(job, ignore_errors=True)


def flink_settings(cfg: JoinerConfig, restore: Path | None) -> dict[str, str]:
    """The Flink configuration of the job (keys of Flink 2.x)."""
    s = {
        "pipeline.name": JOB_NAME,
        "parallelism.default": str(cfg.parallelism),
        "execution.checkpointing.interval": f"{int(cfg.checkpoint_interval * 1000)} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.dir": (cfg.state / "checkpoints").resolve().as_uri(),
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.num-retained": "2",
        "state.backend.type": "hashmap",
        # a task that fails (a Python worker killed) restarts from the last checkpoint; one that
        # keeps failing (a bug) fails the job, and this process exits 1
        "restart-strategy.type": "failure-rate",
        "restart-strategy.failure-rate.max-failures-per-interval": "5",
        "restart-strategy.failure-rate.failure-rate-interval": "5 min",
        "restart-strategy.failure-rate.delay": "2 s",
        "python.executable": cfg.python_executable or sys.executable,
        "python.client.executable": sys.executable,
        "python.fn-execution.bundle.time": "100",  # ms: flush Python's output promptly
        "table.exec.source.idle-timeout": f"{int(cfg.idle_timeout * 1000)} ms",
    }
    if cfg.metrics_port:
        s["metrics.reporter.prom.factory.class"] = (
            "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
        )
        s["metrics.reporter.prom.port"] = str(cfg.metrics_port)
    if restore is not None:
        s["execution.state-recovery.path"] = restore.resolve().as_uri()
        s["execution.state-recovery.claim-mode"] = "CLAIM"
    return s


def source_ddl(name: str, folder: Path, columns: str, cfg: JoinerConfig) -> str:
    """A JSON log folder as an event-time table (the same columns take the Kafka connector:
    docs/online.md)."""
    bound = f"{cfg.out_of_orderness:.3f}"
    return f"""
        CREATE TABLE {name} (
            request_id STRING, example INT, event_time_ms BIGINT, {columns},
            et AS TO_TIMESTAMP_LTZ(event_time_ms, 3),
            WATERMARK FOR et AS et - INTERVAL '{bound}' SECOND
        ) WITH (
            'connector' = 'filesystem', 'path' = '{folder.resolve().as_uri()}',
            'format' = 'json', 'json.ignore-parse-errors' = 'true',
            'json.fail-on-missing-field' = 'false',
            'source.monitor-interval' = '{int(cfg.monitor_interval * 1000)} ms'
        )"""


# Impressions and label-1 clicks as one event-time stream: (kind, request_id, example,
# event_time_ms, row, et); `row` is a keyword in Flink SQL.
UNION = f"""
    SELECT 'i' AS kind, request_id, example, event_time_ms, `row`, et FROM {IMPRESSIONS}
    UNION ALL
    SELECT 'c' AS kind, request_id, example, event_time_ms, CAST(NULL AS STRING), et
    FROM {CLICKS} WHERE label = 1"""


def build(cfg: JoinerConfig, restore: Path | None):  # -> StreamExecutionEnvironment
    """The job graph, on an environment configured by :func:`flink_settings`."""
    from pyflink.common import Configuration, Types
    from pyflink.common.serialization import Encoder
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.connectors.file_system import (
        BucketAssigner,
        FileSink,
        OutputFileConfig,
        RollingPolicy,
    )
    from pyflink.table import StreamTableEnvironment

    from streaming.join import Join

    conf = Configuration()
    for key, value in flink_settings(cfg, restore).items():
        conf.set_string(key, value)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    if cfg.metrics_port:  # a local MiniCluster finds no plugins folder: the reporter's jar
        import pyflink  # (on a cluster, its plugins/metrics-prometheus holds it already)

        jars = Path(pyflink.__file__).parent.glob("plugins/metrics-prometheus/*.jar")
        env.add_jars(*(j.as_uri() for j in jars))
    t_env = StreamTableEnvironment.create(env)
    for key in ("table.exec.source.idle-timeout",):
        t_env.get_config().set(key, conf.get_string(key, ""))
    t_env.execute_sql(source_ddl(IMPRESSIONS, cfg.logdir / IMPRESSIONS, "`row` STRING", cfg))
    t_env.execute_sql(source_ddl(CLICKS, cfg.logdir / CLICKS, "label INT", cfg))
    events = t_env.to_data_stream(t_env.sql_query(UNION))
    ms = 1000
    join = Join(int(cfg.window * ms), int(cfg.retention_s * ms), int(cfg.wall_close_s * ms),
                cfg.early_positives)  # fmt: skip
    joined = (
        events.key_by(lambda r: f"{r[1]}\x1f{r[2]}", key_type=Types.STRING())
        .process(join, output_type=Types.STRING())
        .name("join")
        .uid("join")
    )
    sink = (
        FileSink.for_row_format(
            str((cfg.state / "staging").resolve()), Encoder.simple_string_encoder()
        )
        .with_output_file_config(
            OutputFileConfig.builder()
            .with_part_prefix(PART_PREFIX)
            .with_part_suffix(".tsv")
            .build()
        )
        .with_rolling_policy(RollingPolicy.on_checkpoint_rolling_policy())
        .with_bucket_assigner(BucketAssigner.base_path_bucket_assigner())
        .build()
    )
    joined.sink_to(sink).name("staging").uid("staging")
    return env


def run(cfg: JoinerConfig) -> int:
    """Start the job, then move committed rows into ``out`` until stopped (SIGTERM/SIGINT:
    cancel the job, its last checkpoint kept) or the job ends (its exit status)."""
    state = cfg.state
    mover = Mover(state / "staging", cfg.out, cfg.manifest_path, state / "mover.json", cfg.min_rows)
    mover.recover()
    (state / "checkpoints").mkdir(parents=True, exist_ok=True)
    restore = latest_checkpoint(state / "checkpoints")
    drop_old_checkpoints(state / "checkpoints", restore)
    logger.info("joiner: %s -> %s (W %.1f s); %s", cfg.logdir, cfg.out, cfg.window,
                f"resuming from {restore}" if restore else "no checkpoint: from the start")  # fmt: skip
    client = build(cfg, restore).execute_async(JOB_NAME)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    status = "RUNNING"
    while not stop:
        mover.step()
        status = str(client.get_job_status().result())
        if status in ("FAILED", "CANCELED", "FINISHED"):
            break
        time.sleep(cfg.move_interval)
    if stop:
        logger.info("joiner: stopping (the latest checkpoint stays in %s)", state / "checkpoints")
        try:
            client.cancel().result()
        except Exception as e:  # the job ended meanwhile: nothing to cancel
            logger.info("joiner: cancel: %s", str(e).splitlines()[0])
        return 0
    logger.error("joiner: the Flink job ended %s (its log: the output above)", status)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = config_parser(
        JoinerConfig,
        prog="python -m streaming.joiner",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Runs under .venv-flink (make flink-setup) with PYTHONPATH=<repository root>.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cfg = from_args(JoinerConfig, parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # the Python workers Flink starts import streaming.join by name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    # Flink's own log (the JVM's: the MiniCluster, checkpoints, the reporter) beside its state
    os.environ.setdefault("FLINK_LOG_DIR", str((cfg.state / "log").resolve()))
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
