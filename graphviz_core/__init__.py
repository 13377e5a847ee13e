"""graphviz_core: capture a real backward pass, annotate its autograd graph, and explain what it costs.

Importing this package imports no Streamlit, no pyvis and never initialises CUDA.
"""

__version__ = "0.1.0"
