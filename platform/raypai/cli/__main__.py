from raypai.cli.main import main

main()
