"""Plotly figures and ipywidgets panels, one module per notebook topic.

Every panel is a thin view: it calls a pure function of ``kvlab`` (which tests and
notebook cells call directly) and draws the result. Nothing outside notebooks imports
this package.
"""

from kvlab.viz.static import use_static_fallback

use_static_fallback()  # every figure also as HTML that draws itself: plain nbconvert pages show them too
