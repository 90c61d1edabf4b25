"""Reports: ``report.json``, the one comparison writer, plots."""
