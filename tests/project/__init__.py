"""The repository as a whole: the import layers, house style, private names, this folder
layout, the capability table."""
