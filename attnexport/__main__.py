from attnexport.cli import main

main()
