"""Report outputs: HTML/Markdown/JSON rendering, figures, comparison rendering, trace export."""
