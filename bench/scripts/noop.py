"""Row 5's script: does nothing, so the time a launch takes is the launcher's own."""
