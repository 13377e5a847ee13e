"""The graph schema: categories of autograd nodes, views over a captured graph, and its layout."""
