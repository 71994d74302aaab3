"""Plotly figures and ipywidgets panels, one module per notebook topic.

Every panel is a thin view: it calls a pure function of ``kvlab`` (which tests and
notebook cells call directly) and draws the result. Nothing outside notebooks imports
this package.
"""
