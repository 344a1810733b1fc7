"""``accelerate.commands``' names at Accelerate's path (``hasten.cli`` is hasten's command line).

``hasten.commands.launch``: ``launch_command_parser()`` and ``launch_command(args)``, which run
``hasten launch`` (TRL's CLI launches its scripts through them); ``hasten.commands.config``:
``default_config_file`` and ``load_config_from_file`` (``transformers env``, ``trl env``).
"""
