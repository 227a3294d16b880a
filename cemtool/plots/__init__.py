"""Figures from saved reports (never recomputes, never imports models). One module per analysis."""
