"""draftsmith's serving layouts: each method's writers and readers for the engines that serve it.

A floor above heads/ (it reads the modules and artifacts there, nothing reads it from below):
layouts/eagle.py, layouts/medusa.py and layouts/draft.py hold one method's layouts each,
layouts/files.py what they share, layouts/table.py the floor's table and layouts/export.py the
command (``draftsmith export``) that dispatches over them.
"""
