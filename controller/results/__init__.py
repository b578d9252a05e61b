"""What a run leaves behind (bench and twin alike): records, summaries, run directories, tables, reports.

What a run leaves behind, bench and twin alike, and how it is shown: ``records.py`` (per-request records,
the time series, goodput maths and the summary; the run directory's three files, ``write_run`` and
``read_summary``), ``tables.py`` (the summary tables, the servers' and the twin's, as columns through one
renderer; the order run directories are listed in; the terminal summaries), ``report.py`` (``bench
report``: plots and a markdown report over run directories). May import ``percentile`` only: a report
reads run directories, never the code that wrote them.
"""
